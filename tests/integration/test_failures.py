"""Issue 11's observations, each in real processes on shm and tcp: concurrent and async
calls never mix, a timeout aborts the group everywhere instead of leaving the ranks out
of step, ranks naming different roots all raise ``CollectiveMismatch`` at once, and a
killed rank is the one every survivor names (also when the ranks were started by hand).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", *args], capture_output=True, text=True, timeout=timeout
    )


def by_hand(n: int, script: Path, *args: str, timeout: float = 120) -> list[int]:
    """Start ``n`` ranks as separate processes (no launcher), as SLURM or mpiexec would."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n))
    ranks = [
        subprocess.Popen([sys.executable, str(script), *args], env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL)
        for r in range(n)
    ]
    return [p.wait(timeout) for p in ranks]


def logs(outdir: Path) -> dict[int, list[dict]]:
    return {
        int(p.stem[4:]): [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(outdir.glob("rank*.jsonl"))
    }


@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("mode", ["groups", "async", "mixed"])
def test_concurrent_and_async_calls_never_mix(mode, backend):
    done = launch("-n", "3", str(SCRIPTS / "ordering.py"), mode, backend, "40")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(f"ok {mode}") == 3


@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("stopped", [1, 0], ids=["rank-1", "rank-0-the-store-host"])
def test_a_rank_stopped_past_the_deadline_aborts_the_group_instead_of_leaving_it_out_of_step(
    tmp_path, backend, stopped
):
    mode = "stop0" if stopped == 0 else "stop"
    done = launch("-n", "3", str(SCRIPTS / "observations.py"), mode, str(tmp_path), backend)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank, entries in logs(tmp_path).items():
        assert len(entries) == 30
        assert not [e for e in entries if e["outcome"] == "wrong"], entries
        assert all(e["outcome"] == "ok" for e in entries[:5])
        failed = [e for e in entries if e["outcome"] == "error"]
        first = failed[0]
        # Once a call failed, every later call on the group fails at once, on every rank.
        assert [e["i"] for e in failed] == list(range(first["i"], 30)), entries
        assert all(e["class"] == "GroupAborted" and e["seconds"] < 0.5 for e in failed[1:])
        if rank != stopped:
            assert first["class"] == "CollectiveTimeout", first
            assert first["waiting_for"] == [stopped], first  # the stopped rank, named by its silence
            assert f"no word from rank {stopped}" in first["message"]
            assert first["seconds"] < 2 + 1.0  # the deadline plus the stated slack, even without the store
        else:  # woken up: its call was given up by the others; it is told so
            assert first["class"] in ("CollectiveTimeout", "GroupAborted"), first


@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("op", ["broadcast", "reduce", "gather", "scatter"])
def test_ranks_naming_different_roots_all_raise_a_mismatch_at_once(tmp_path, op, backend):
    done = launch("-n", "3", str(SCRIPTS / "observations.py"), f"roots-{op}", str(tmp_path), backend)
    assert done.returncode == 0, done.stdout + done.stderr
    entries = logs(tmp_path)
    assert sorted(entries) == [0, 1, 2]
    for rank, (entry,) in entries.items():
        assert entry["outcome"] == "error", (rank, entry)
        assert entry["class"] == "CollectiveMismatch", (rank, entry)
        assert entry["seconds"] < 2, (rank, entry)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_a_barrier_never_passes_a_peer_in_another_collective(tmp_path, backend):
    done = launch("-n", "2", str(SCRIPTS / "observations.py"), "barrier", str(tmp_path), backend)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank, (entry,) in logs(tmp_path).items():
        assert entry["class"] == "CollectiveMismatch", (rank, entry)
        assert entry["seconds"] < 2
        assert "barrier" in entry["message"] and "all_reduce" in entry["message"]


def test_every_survivor_names_the_killed_rank_when_started_by_hand(tmp_path):
    codes = by_hand(4, SCRIPTS / "observations.py", "kill", str(tmp_path), "tcp")
    assert codes[2] == -9
    for rank, entries in logs(tmp_path).items():
        if rank == 2:
            continue
        assert not [e for e in entries if e["outcome"] == "wrong"]
        first = next(e for e in entries if e["outcome"] == "error")
        assert first["class"] == "PeerLost", (rank, first)
        assert first["peer"] == 2, (rank, first)
        assert "rank 2" in first["message"]
        assert first["seconds"] < 2
