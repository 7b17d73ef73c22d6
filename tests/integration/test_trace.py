"""``ferrodist run --trace DIR`` on real processes over shared memory and TCP: every rank
writes its trace, the launcher merges them, names the rank the others waited for, and the
merged file holds collectives, messages, DDP buckets and pipeline actions of both ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ferrodist.ddp")
pytest.importorskip("ferrodist.pipeline")

SCRIPT = Path(__file__).parent / "scripts" / "traced.py"


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_ferrodist_run_trace_merges_every_ranks_timeline(tmp_path, backend):
    trace = tmp_path / "trace"
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", "2", "--trace", str(trace), str(SCRIPT), backend],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"rank 1 traced over {backend}" in done.stdout
    assert "ferrodist trace: 2 ranks" in done.stdout and str(trace / "trace.json") in done.stdout
    assert "| world | #2 | all_reduce | 1 |" in done.stdout, done.stdout
    events = json.loads((trace / "trace.json").read_text())["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X"]
    for rank in (0, 1):
        kinds = {e["cat"] for e in complete if e["pid"] == rank}
        assert kinds == {"collective", "p2p", "ddp", "pipeline"}, (rank, kinds)
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"group world", "DDP buckets", "pipeline actions"} <= names
