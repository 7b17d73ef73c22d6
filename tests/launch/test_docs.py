"""docs/launch.md documents every option of every `ferrodist` command, each in its own section."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")
from ferrodist.launch._cli import _parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "launch.md"


def sections() -> dict[str, str]:
    """Each ``# `ferrodist CMD` `` section of docs/launch.md, by command."""
    text = DOC.read_text()
    found = re.split(r"^# `ferrodist (\w+)`\s*$", text, flags=re.MULTILINE)
    return dict(zip(found[1::2], found[2::2], strict=True))


def options(command: str) -> list[str]:
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = commands.choices[command]
    return [o for action in parser._actions for o in action.option_strings if o not in ("-h", "--help")]


@pytest.mark.parametrize("command", ["run", "warm", "trace", "bench", "doctor"])
def test_every_option_is_documented_in_its_section(command):
    section = sections()[command]
    missing = [o for o in options(command) if not re.search(rf"`[^`]*(?<![\w-]){re.escape(o)}(?![\w-])", section)]
    assert not missing, f"docs/launch.md, `ferrodist {command}`, does not document {missing}"


def test_the_run_section_shows_a_job_of_two_nodes():
    section = sections()["run"]
    for node in (0, 1):
        assert re.search(rf"ferrodist run .*--nnodes 2 --node-rank {node} --master-addr ", section), node
    assert "export FERRODIST_TOKEN=" in section
