"""A lost rank in real processes, on tcp and shm: the survivors shrink the group and go on
with exact results; a killed rank (rank 0, the store's host, too) costs them well under two
seconds; a rank stopped past the timeout is left out, and told so when it wakes up."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "shrink.py"


def start(n: int, *args: str) -> list[subprocess.Popen[bytes]]:
    """``n`` ranks started by hand (no launcher: it would end the job at the first loss)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n))
    return [
        subprocess.Popen([sys.executable, str(SCRIPT), *args], env=dict(env, **_place(r, args)), stderr=subprocess.PIPE)
        for r in range(n)
    ]


def _place(rank: int, args: tuple[str, ...]) -> dict[str, str]:
    """The variables of a rank: with backend levels, two simulated nodes (ranks 0-1, 2-3),
    as a launcher per node would say."""
    if "levels" not in args:
        return {"RANK": str(rank)}
    return {"RANK": str(rank), "GROUP_RANK": str(rank // 2), "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2"}


def finish(ranks: list[subprocess.Popen[bytes]], outdir: Path) -> tuple[list[int | None], dict[int, dict]]:
    codes = []
    for p in ranks:
        try:
            codes.append(p.wait(90))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(None)
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in outdir.glob("rank*.json")}
    return codes, results


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("victim", [2, 0], ids=["rank-2", "rank-0-the-store-host"])
def test_the_survivors_of_a_killed_rank_shrink_and_go_on_exactly(tmp_path, backend, victim):
    ranks = start(4, "kill", str(tmp_path), backend, str(victim))
    codes, results = finish(ranks, tmp_path)
    errors = {r: p.stderr.read().decode()[-2000:] for r, p in enumerate(ranks) if p.stderr}  # type: ignore[union-attr]
    assert codes[victim] == -9, errors
    live = [r for r in range(4) if r != victim]
    assert [codes[r] for r in live] == [0, 0, 0], errors
    lost_at = float((tmp_path / "lost_at").read_text())
    for r in live:
        result = results[r]
        assert result["outcome"] == "done" and result["ranks"] == live, result
        assert result["shrunk_to"] == live and result["wrong"] == [], result
        # the kill, its detection, the shrink and the next step: well within 2 s of wall clock
        assert result["recovered"] - lost_at < 2.0, result


def test_the_survivors_of_a_lost_node_of_a_two_level_job_shrink_and_go_on(tmp_path):
    """Two simulated nodes of two ranks each over the levels backend; both ranks of node 1
    are killed at the same step: node 0's ranks shrink to a group of two and go on."""
    ranks = start(4, "kill", str(tmp_path), "levels", "2,3")
    codes, results = finish(ranks, tmp_path)
    errors = {r: p.stderr.read().decode()[-2000:] for r, p in enumerate(ranks) if p.stderr}  # type: ignore[union-attr]
    assert codes == [0, 0, -9, -9], errors
    for r in (0, 1):
        assert results[r]["outcome"] == "done" and results[r]["ranks"] == [0, 1], results[r]
        assert results[r]["shrunk_to"] == [0, 1] and results[r]["wrong"] == [], results[r]


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_rank_stopped_past_the_timeout_is_left_out_and_told_so(tmp_path, backend):
    ranks = start(4, "stop", str(tmp_path), backend, "1")
    codes, results = finish(ranks, tmp_path)
    errors = {r: p.stderr.read().decode()[-2000:] for r, p in enumerate(ranks) if p.stderr}  # type: ignore[union-attr]
    assert codes == [0, 0, 0, 0], errors
    for r in (0, 2, 3):
        assert results[r]["outcome"] == "done" and results[r]["ranks"] == [0, 2, 3], results[r]
        assert results[r]["wrong"] == [], results[r]
    stopped = results[1]
    assert stopped["outcome"] == "excluded" and stopped["survivors"] == [0, 2, 3], stopped


def test_an_elastic_launch_keeps_the_survivors_running_and_succeeds_with_them(tmp_path):
    """``ferrodist run -n 3:4``: rank 2 is killed, the launcher lets the other three go on
    (they shrink and finish) and the job succeeds, naming the rank it lost."""
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", "3:4", str(SCRIPT), "kill", str(tmp_path), "shm", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ranks [2] failed; the other 3 go on (at least 3 must)" in done.stdout, done.stdout
    assert "the job finished on 3 of 4 ranks; ranks [2] failed" in done.stdout, done.stdout
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")}
    assert sorted(results) == [0, 1, 3]
    assert all(r["outcome"] == "done" and r["ranks"] == [0, 1, 3] and not r["wrong"] for r in results.values())


def test_an_elastic_launch_stops_the_job_below_its_minimum(tmp_path):
    """``ferrodist run -n 3:4`` with ranks 1 and 2 killed: two are left, fewer than three,
    so the launcher stops the job and blames a killed rank."""
    command = [sys.executable, "-m", "ferrodist.launch", "run", "-n", "3:4", str(SCRIPT), "kill", str(tmp_path)]
    done = subprocess.run([*command, "tcp", "1,2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 137, done.stdout + done.stderr
    assert re.search(r"rank [12] was killed by SIGKILL", done.stdout + done.stderr), done.stdout + done.stderr


def test_a_replacement_joins_at_a_commit_point_and_gets_the_state_from_a_peer(tmp_path):
    """``ferrodist run -n 3:4``: rank 3 is killed, the other three go on, the launcher starts
    a replacement that joins their group at a commit point (within 5 s of its start) with
    the state sent by a peer, and all four finish with the same parameters, to the bit."""
    script = Path(__file__).parent / "scripts" / "grow.py"
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", "3:4", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 3's replacement starts" in done.stdout, done.stdout
    records = [json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")]
    assert len(records) == 4, done.stdout
    assert all(r["ranks"] == [0, 1, 2, 3] for r in records), records
    assert len({r["params"] for r in records}) == 1  # the replacement holds what the others hold
    (joined,) = [r for r in records if r["replacement"]]
    step, members, age = joined["calls"][0]
    assert members == [0, 1, 2, 3] and 13 <= step < 60, joined["calls"]
    assert age < 5.0, joined["calls"]  # back at four ranks within 5 s of the replacement's start
    for r in records:
        if not r["replacement"]:
            assert [c[1] for c in r["calls"]] == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3]], r["calls"]
