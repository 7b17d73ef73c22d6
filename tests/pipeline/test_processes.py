"""Pipelines in real processes over shm and tcp (`ferrodist run`), and the hybrid on 4 ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import free_port

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


def test_every_survivor_names_the_stopped_stage_not_its_waiting_neighbour(tmp_path):
    """Rank 1 of 4 is stopped (SIGSTOP) in a step: ranks 0 and 2 wait for it, rank 3 for
    rank 2, which is healthy and waiting too. Every survivor's error names rank 1. (Messages
    take the TCP links on the shm backend too: tcp alone covers both.)"""
    backend = "tcp"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="4")
    script = Path(__file__).parent / "scripts" / "stall.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), backend, str(tmp_path)],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="4"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in range(4)
    ]
    try:
        give_up = time.monotonic() + 120
        for r in (0, 2, 3):
            procs[r].wait(max(0.1, give_up - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
    for r in (0, 2, 3):
        record = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert record["class"] == "CollectiveTimeout" and record["waiting_for"] == [1], (r, record)
