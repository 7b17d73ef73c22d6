"""Pipelines in real processes over shm and tcp (`ferrodist run`), and the hybrid on 4 ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "train.py"


def run(ranks: int, *args: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", str(ranks), str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line.split("] ", 1)[1]) for line in done.stdout.splitlines() if '"difference"' in line]
    assert sorted(r["rank"] for r in rows) == list(range(ranks)), done.stdout
    return rows


@pytest.mark.parametrize(
    ("backend", "schedule"),
    [("shm", "1f1b"), ("shm", "zb"), ("tcp", "gpipe"), ("tcp", "interleaved")],
)
def test_two_stages_in_real_processes_equal_the_unsplit_model(backend, schedule):
    for row in run(2, backend, schedule):
        assert row["ok"] and row["size"] == 2, row


def test_the_hybrid_in_four_real_processes():
    for row in run(4, "shm", "1f1b", "hybrid"):
        assert row["ok"] and row["size"] == 4, row


def test_the_example_trains_and_equals_one_process():
    example = Path(__file__).parents[2] / "examples" / "train_pipeline.py"
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", "4", str(example), "--epochs", "3", "--schedule", "zb"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "epoch  3: loss" in done.stdout and "test accuracy" in done.stdout
    assert "(equal)" in done.stdout, done.stdout
