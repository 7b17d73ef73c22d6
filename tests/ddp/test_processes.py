"""The equivalence proof in real processes over shm and tcp (`ferrodist run`)."""

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
    ("backend", "ranks", "kind", "optimizer", "overlap"),
    [
        ("shm", 2, "nn", "sgd", "on"),
        ("shm", 4, "nn", "adam", "on"),
        ("tcp", 2, "nn", "adam", "off"),
        ("tcp", 4, "nn", "sgd", "on"),
        ("shm", 2, "torch", "adam", "on"),
        ("tcp", 2, "torch", "sgd", "off"),
    ],
)
def test_real_processes_train_exactly_like_one(backend, ranks, kind, optimizer, overlap):
    if kind == "torch":
        pytest.importorskip("torch")
    for row in run(ranks, backend, kind, optimizer, overlap):
        assert row["ok"] and row["size"] == ranks, row
