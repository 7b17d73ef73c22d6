"""The shm arena leaves nothing in /dev/shm when rank 0 is killed at the worst moment, with
ranks started by hand (no launcher to clean up), and the other rank names rank 0 at once."""

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

SCRIPT = Path(__file__).parent / "scripts" / "shm_arena.py"

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm (Linux)")


def ferrodist_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("ferrodist-*")}


def start_ranks(mode: str, outdir: Path, **env: str) -> list[subprocess.Popen[str]]:
    """Two ranks of ``shm_arena.py``, started the way a user without a launcher would."""
    common = dict(
        os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), FERRODIST_TOKEN="t", **env
    )
    common.pop("FERRODIST_JOB_ID", None)
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), mode, str(outdir)],
            env=dict(common, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]


def wait_for(path: Path, procs: list[subprocess.Popen[str]], seconds: float = 30) -> None:
    give_up = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > give_up or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            outputs = [p.communicate()[0] for p in procs]
            pytest.fail(f"{path.name} never appeared; the ranks said {outputs}")
        time.sleep(0.01)


def finish(procs: list[subprocess.Popen[str]], seconds: float = 30) -> list[str]:
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=seconds)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0])
    return outputs


def check_rank_1_names_rank_0(outdir: Path, killed_at: float, outputs: list[str]) -> None:
    error = json.loads((outdir / "error1.json").read_text())
    assert error["class"] == "PeerLost", (error, outputs)
    assert error["peer"] == 0
    assert "rank 0" in error["message"] and "shared-memory arena" in error["message"], error
    # It raised as soon as rank 0 was gone, far inside its 20 s timeout.
    assert (outdir / "error1.json").stat().st_mtime - killed_at < 5


@pytest.mark.parametrize("mode", ["pause-after-create", "late-peer", "pause-before-attach"])
def test_rank_0_killed_while_the_arena_is_being_shared_leaves_nothing(tmp_path, mode):
    before = ferrodist_files()
    procs = start_ranks(mode, tmp_path)
    wait_for(tmp_path / ("published" if mode == "pause-before-attach" else "created"), procs)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait(10)
    killed_at = time.time()
    (tmp_path / "go").write_text("")
    outputs = finish(procs)
    assert procs[0].returncode == -signal.SIGKILL
    assert procs[1].returncode == 1, outputs
    check_rank_1_names_rank_0(tmp_path, killed_at, outputs)
    assert ferrodist_files() <= before, "a killed rank 0 left its arena in /dev/shm"


def test_without_memfd_the_next_arena_removes_the_file_a_killed_rank_0_left(tmp_path):
    before = ferrodist_files()
    first = tmp_path / "first"
    first.mkdir()
    procs = start_ranks("pause-after-create", first, FERRODIST_SHM_MEMFD="0")
    wait_for(first / "created", procs)
    pid = procs[0].pid
    left = ferrodist_files() - before
    assert [name.split("-")[3] for name in left] == [str(pid)]  # the file names its creator
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait(10)
    finish(procs)
    assert ferrodist_files() - before == left  # named files cannot clean up after a kill...
    second = tmp_path / "second"
    second.mkdir()
    procs = start_ranks("ok", second, FERRODIST_SHM_MEMFD="0")
    outputs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert ferrodist_files() <= before  # ...but the next job's rank 0 removed it


def test_ranks_started_by_hand_share_the_arena_and_leave_nothing(tmp_path):
    before = ferrodist_files()
    procs = start_ranks("ok", tmp_path)
    outputs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "rank 0 ok" in outputs[0] and "rank 1 ok" in outputs[1]
    assert ferrodist_files() <= before


def test_a_rank_killed_before_it_mapped_the_arena_is_named_by_rank_0_at_once(tmp_path):
    before = ferrodist_files()
    procs = start_ranks("pause-before-attach", tmp_path)
    wait_for(tmp_path / "published", procs)
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait(10)
    killed_at = time.time()
    outputs = finish(procs)
    assert procs[0].returncode == 1, outputs
    error = json.loads((tmp_path / "error0.json").read_text())
    assert error["class"] == "PeerLost" and error["peer"] == 1, error
    assert "rank 1" in error["message"] and "shared-memory arena" in error["message"], error
    assert (tmp_path / "error0.json").stat().st_mtime - killed_at < 5  # not its 20 s timeout
    assert ferrodist_files() <= before
