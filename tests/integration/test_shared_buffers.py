"""Arrays in the group's shared memory (``shared_zeros``): an all_reduce over them reads the
peers' arrays in place, touches no slot of the arena, gives numpy's values and the slots'
bits call after call, holds when the ranks run out of step, and a kill -9 leaves nothing in
/dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ferrodist.collectives as dist
from _helpers import free_port
from ferrodist.core import InvalidArgument
from ferrodist.testing import run_world

SCRIPT = Path(__file__).parent / "scripts" / "shared_buffers.py"

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm (Linux)")


def ferrodist_run(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ferrodist.launch", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, **(env or {})),
    )


def reports(outdir: Path, ranks: int, job: subprocess.Popen[str]) -> list[dict[str, object]]:
    output = job.communicate(timeout=240)[0]
    assert job.returncode == 0, output
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(ranks)]


def ferrodist_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("ferrodist-*")}


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_all_reduce_on_shared_arrays_reads_in_place_and_gives_the_slots_bits(tmp_path, ranks):
    got = reports(tmp_path, ranks, ferrodist_run("-n", str(ranks), str(SCRIPT), "check", str(tmp_path)))
    for report in got:
        assert report["calls"] == 36 and report["slots_untouched"] == 36, report  # no byte through a slot
        assert report["plain_touched_slots"] and report["plain_ok"], report  # the check can see a slot copy
        assert report["same_bits_float32"] and report["same_bits_float64"] and report["same_bits_bfloat16"], report


def test_ranks_out_of_step_never_read_an_array_too_early_or_too_late(tmp_path):
    """Each of the in-place all_reduce's three waits is needed here: without any one of
    them rank 1 gets a wrong value."""
    got = reports(tmp_path, 2, ferrodist_run("-n", "2", str(SCRIPT), "race", str(tmp_path)))
    assert [r["race_calls"] for r in got] == [6, 6]


@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_buckets_live_in_shared_memory_and_train_like_one_process(tmp_path, ranks):
    """The buckets whose all_reduce reads in place (1 MiB to 16 MiB) are in shared memory,
    the others (here a small one) ordinary arrays; training matches one process."""
    got = reports(tmp_path, ranks, ferrodist_run("-n", str(ranks), str(SCRIPT), "ddp", str(tmp_path)))
    for report in got:
        assert report["shared"] == report["in_range"] == report["in_place"] >= 1, report
        assert report["buckets"] > report["shared"], report
        assert float(report["difference"]) < 1e-12, report  # type: ignore[arg-type]


def test_torch_ddp_shares_the_buckets_it_copies_into_and_not_a_lone_parameters(tmp_path):
    """A bucket of one PyTorch parameter averages autograd's gradient where it is: it stays
    an ordinary array even at a size that reads in place; a bucket of two is shared."""
    got = reports(tmp_path, 2, ferrodist_run("-n", "2", str(SCRIPT), "ddp-torch", str(tmp_path)))
    for report in got:
        assert report["buckets"] == [[1, 2096640, False], [2, 2298240, True]], report
        assert float(report["difference"]) < 1e-12, report  # type: ignore[arg-type]


def test_a_rank_with_an_ordinary_array_makes_every_rank_fail_saying_so(tmp_path):
    got = reports(tmp_path, 2, ferrodist_run("-n", "2", str(SCRIPT), "mismatch", str(tmp_path)))
    for report in got:
        assert report["error"] == "CollectiveMismatch", report
        assert "shared memory, read in place" in str(report["message"]), report


def test_ranks_passing_different_places_of_the_shared_memory_fail_saying_so(tmp_path):
    got = reports(tmp_path, 2, ferrodist_run("-n", "2", str(SCRIPT), "places", str(tmp_path)))
    for report in got:
        assert report["error"] == "CollectiveMismatch", report
        assert "another place of the group's shared memory" in str(report["message"]), report


@pytest.mark.parametrize("memfd", ["1", "0"])
def test_a_rank_killed_while_it_holds_shared_arrays_leaves_nothing(tmp_path, memfd):
    """Ranks started by hand (no launcher to clean up after them); with memfd segments and
    with named files in /dev/shm (``FERRODIST_SHM_MEMFD=0``)."""
    before = ferrodist_files()
    common = dict(
        os.environ,
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        FERRODIST_TOKEN="t",
        FERRODIST_SHM_MEMFD=memfd,
        FERRODIST_TIMEOUT="10",
    )
    common.pop("FERRODIST_JOB_ID", None)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "hold", str(tmp_path)],
            env=dict(common, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        give_up = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert all(r.poll() is None for r in ranks) and time.monotonic() < give_up, "rank 1 never got ready"
            time.sleep(0.05)
        time.sleep(0.05)
        ranks[1].send_signal(signal.SIGKILL)
        output = ranks[0].communicate(timeout=120)[0]
        assert ranks[0].returncode != 0 and "PeerLost" in output, output
    finally:
        for rank in ranks:
            rank.kill()
            rank.communicate()
    assert ferrodist_files() - before == set(), output


def test_shared_zeros_is_an_ordinary_array_where_the_ranks_share_no_memory():
    """On a group without shared memory (here simulated ranks) the same code runs."""

    def body() -> np.ndarray:
        x = dist.shared_zeros((2, 3), np.float64)
        assert x.shape == (2, 3) and x.dtype == np.float64 and not x.any()
        x += dist.get_rank() + 1
        dist.all_reduce(x)
        return x

    for got in run_world(2, body):
        assert (got == 3).all()


def test_shared_zeros_refuses_a_negative_size():
    def body() -> str:
        with pytest.raises(InvalidArgument) as caught:
            dist.shared_zeros((2, -1))
        return str(caught.value)

    for said in run_world(2, body):
        assert "negative" in said
