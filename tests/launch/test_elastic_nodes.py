"""`ferrodist run -n MIN:MAX --nnodes N`: an elastic job over several nodes. The launchers keep
one join directory on every node (``_nodes.joins``), so a replacement started on one node is
taken in by a group whose lowest member runs on another; a node goes on while at least MIN
of its ranks have not failed, and one that falls below stops every node. Two launchers on
127.0.0.1 here; bench/elastic/recovery.py runs them in two network namespaces."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import communicate_all, free_port

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")
from ferrodist.launch._nodes.joins import Joins
from ferrodist.launch._nodes.judge import Node, judge

SCRIPTS = Path(__file__).parents[1] / "integration" / "scripts"
_PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _sync(a: Joins, b: Joins) -> int:
    """Pass ``a``'s changes to ``b`` and ``b``'s to ``a``, as the launchers do; how many were applied."""
    applied = sum(b.apply(change) for change in a.changes())
    return applied + sum(a.apply(change) for change in b.changes())


def test_the_join_directory_is_the_same_on_both_nodes_and_nothing_comes_back(tmp_path):
    one, two = tmp_path / "node0", tmp_path / "node1"
    one.mkdir()
    two.mkdir()
    a, b = Joins(one), Joins(two)
    (two / "joiner-3.json").write_text('{"rank": 3, "address": "10.0.0.2:4000"}')
    assert _sync(a, b) == 1
    assert (one / "joiner-3.json").read_text() == '{"rank": 3, "address": "10.0.0.2:4000"}'
    assert _sync(a, b) == 0  # applied changes are not sent back
    # node 0's lowest member takes rank 3 in: the answer appears, the word goes, on node 1 too
    (one / "group-3.json").write_text('{"members": [0, 1, 2, 3]}')
    (one / "joiner-3.json").unlink()
    assert _sync(a, b) == 2
    assert sorted(os.listdir(two)) == ["group-3.json"]
    assert (two / "group-3.json").read_text() == '{"members": [0, 1, 2, 3]}'
    assert not [name for name in os.listdir(one) if name.startswith(".")]  # nothing left aside


def test_forgetting_a_dead_replacement_does_not_erase_the_next_ones_word(tmp_path):
    one, two = tmp_path / "node0", tmp_path / "node1"
    one.mkdir()
    two.mkdir()
    a, b = Joins(one), Joins(two)
    (two / "joiner-3.json").write_text("first")
    _sync(a, b)
    (one / "joiner-3.json").unlink()  # node 0: the first replacement died before it was taken in
    (two / "joiner-3.json").write_text("second")  # node 1: meanwhile, the next one says where it listens
    forget, word = a.changes(), b.changes()
    assert b.apply(forget[0]) is False  # crossing: node 1 keeps the newer word
    assert a.apply(word[0]) is True
    assert (one / "joiner-3.json").read_text() == (two / "joiner-3.json").read_text() == "second"


@pytest.mark.parametrize("name", ["../evil.json", "joiner-3.json/../../x", "notes.txt", ".joiner-3.json.123", 7])
def test_a_change_to_anything_but_the_join_files_is_refused(tmp_path, name):
    joins = Joins(tmp_path)
    assert joins.apply({"name": name, "text": "x", "was": None}) is False
    assert os.listdir(tmp_path) == []


def test_judge_does_not_blame_the_ranks_an_elastic_node_went_on_without():
    nodes = (Node(0, "a", 1, 0, 2), Node(1, "b", 2, 2, 2))
    rows = [{"rank": r, "code": 0, "seen": i, "at": 9.0, "stopped": None, "error": None} for i, r in enumerate((0, 1))]
    lost = [{"rank": 3, "code": -9, "seen": 0, "at": 2.0, "stopped": None, "error": None}]
    lost += [{"rank": 2, "code": 0, "seen": 1, "at": 9.0, "stopped": None, "error": None}]
    outcome = judge(nodes, {0: {"ends": rows}, 1: {"ends": lost, "went_on": [3]}}, {}, None)
    assert (outcome.exit_code, outcome.failed_rank) == (0, None)
    assert outcome.summary == "ferrodist run: the job finished on 3 of 4 ranks; ranks [3] failed"
    blamed = judge(nodes, {0: {"ends": rows}, 1: {"ends": lost}}, {}, None)  # not elastic: rank 3 is to blame
    assert (blamed.exit_code, blamed.failed_rank, blamed.failed_node) == (137, 3, 1)


def _two_launchers(shape: str, script: Path, *args: str, second: str | None = None) -> tuple[list[int], list[str]]:
    """``ferrodist run --nnodes 2 -n SHAPE`` twice on 127.0.0.1 (node 1 with ``-n SECOND``
    when given): the codes and outputs."""
    env = {k: v for k, v in os.environ.items() if k not in _PLACE}
    env.update(FERRODIST_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
    port, procs = str(free_port()), []
    for node in (0, 1):
        mine = second if node == 1 and second is not None else shape
        options = ["--nnodes", "2", "--node-rank", str(node), "--master-port", port, "-n", mine]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ferrodist.launch", "run", *options, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = communicate_all(procs, 150)
    return [p.returncode for p in procs], outputs


@pytest.mark.timeout(240)
def test_a_replacement_on_node_1_is_taken_in_by_a_group_whose_lowest_member_runs_on_node_0(tmp_path):
    """Rank 3 (node 1) is killed at step 13; node 1's launcher starts a replacement, whose word
    reaches node 0's directory, where rank 0 reads it; the answer comes back; all four end
    with the same parameters, to the bit, and both launchers call the job a success."""
    codes, outputs = _two_launchers("1:2", SCRIPTS / "grow.py", str(tmp_path))
    assert codes == [0, 0], outputs
    assert "rank 3's replacement starts" in outputs[1], outputs[1]
    records = [json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")]
    assert len(records) == 4, outputs
    assert all(r["ranks"] == [0, 1, 2, 3] for r in records), records
    assert len({r["params"] for r in records}) == 1
    (joined,) = [r for r in records if r["replacement"]]
    step, members, age = joined["calls"][0]
    assert members == [0, 1, 2, 3] and 13 <= step < 60 and age < 5.0, joined["calls"]
    for r in records:
        if not r["replacement"]:
            assert [c[1] for c in r["calls"]] == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3]], r["calls"]


@pytest.mark.timeout(240)
def test_a_node_that_falls_below_its_minimum_stops_every_node(tmp_path):
    """``-n 1:2`` on each node; both of node 1's ranks are killed: node 1 has none left, so
    every node stops, and both launchers blame a rank of node 1."""
    codes, outputs = _two_launchers("1:2", SCRIPTS / "shrink.py", "kill", str(tmp_path), "tcp", "2,3")
    assert codes == [137, 137], outputs
    for out in outputs:
        last = out.strip().splitlines()[-1]
        assert "was killed by SIGKILL" in last and "ran on node 1" in last, out


@pytest.mark.timeout(240)
def test_a_node_that_loses_a_rank_above_its_minimum_lets_the_job_finish(tmp_path):
    """``-n 1:2`` on each node; rank 2 (node 1) is killed and the others shrink and finish
    (the script takes no replacement in: the one started waits, and is stopped at the end);
    the job succeeds on both nodes, saying which rank it went on without."""
    codes, outputs = _two_launchers("1:2", SCRIPTS / "shrink.py", "kill", str(tmp_path), "tcp", "2")
    assert codes == [0, 0], outputs
    for out in outputs:
        assert out.strip().splitlines()[-1] == "ferrodist run: the job finished on 3 of 4 ranks; ranks [2] failed", out
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")}
    assert sorted(results) == [0, 1, 3]
    assert all(r["outcome"] == "done" and r["ranks"] == [0, 1, 3] and not r["wrong"] for r in results.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("first", "second"), [("1:2", "2"), ("2", "1:2")])
def test_nodes_started_elastic_and_not_are_refused_on_both_before_any_rank_starts(tmp_path, first, second):
    """One node's ranks would look for replacements at each commit and the other's not: their
    collectives would not match. Both launchers end the job at the start, saying why."""
    codes, outputs = _two_launchers(first, SCRIPTS / "grow.py", str(tmp_path), second=second)
    assert codes == [1, 1], outputs
    for out in outputs:
        assert "node 1 (" in out and "-n MIN:MAX (elastic)" in out and "give every launcher MIN:MAX, or none" in out
    assert not list(tmp_path.glob("rank*.json"))  # no rank ran
