"""The two-level route on simulated nodes (``run_world(nodes=...)``): every collective it runs
gives what numpy computes for any shape of nodes (uneven ones included), any dtype and op,
sizes on both of its paths (one leader per node, and shards with a stream per local rank);
failures in either level fail the call on every rank within its deadline, naming global
ranks and the node; the route is chosen once and printed as the plan."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import examples
from ferrodist.collectives import (
    SimulatedTransport,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    default_group,
    enable_two_levels,
    get_backend,
    get_rank,
    get_world_size,
    new_group,
    reduce,
    reduce_scatter,
)
from ferrodist.collectives._levels.plan import Nodes
from ferrodist.collectives._levels.run import Levels, in_global_ranks
from ferrodist.collectives._levels.steps import SMALL_BYTES
from ferrodist.core import (
    CollectiveMismatch,
    CollectiveTimeout,
    FerrodistError,
    GroupAborted,
    InvalidArgument,
    PeerLost,
    ReduceOp,
    float64,
)
from ferrodist.testing import assert_reduced, run_world

NODES = st.lists(st.integers(1, 3), min_size=2, max_size=3)  # ranks per node, at least two nodes
OPS = ("sum", "avg", "max", "product")
#: counts below the number of shards, on the pairs' path (up to 16 KiB), on the leaders' path,
#: and on the sharded path (float64: 8 bytes each)
COUNTS = (1, 2, 7, 1001, 5001, SMALL_BYTES // 8 + 5)


def _data(rank: int, count: int, dtype: str, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    if dtype.startswith("int"):
        return rng.integers(-3, 4, count).astype(dtype)
    return rng.uniform(0.5, 1.5, count).astype(dtype)


def _every_collective(count: int, dtype: str, op: str) -> dict[str, object]:
    """Each collective the levels run, on this rank: what it returned."""
    rank, size = get_rank(), get_world_size()
    out: dict[str, object] = {"backend": get_backend()}
    x = _data(rank, count, dtype)
    all_reduce(x, op)
    out["all_reduce"] = x
    for root in {0, size - 1, size // 2}:
        y = _data(rank, count, dtype, 1)
        broadcast(y, src=root)
        out[f"broadcast {root}"] = y
        z = _data(rank, count, dtype, 2)
        reduce(z, dst=root, op=op)
        out[f"reduce {root}"] = z
    blocks = [np.zeros(count, dtype) for _ in range(size)]
    all_gather(blocks, _data(rank, count, dtype, 3))
    out["all_gather"] = blocks
    mine = np.zeros(count, dtype)
    reduce_scatter(mine, [_data(rank, count, dtype, 4 + i) for i in range(size)], op)
    out["reduce_scatter"] = mine
    barrier()
    return out


def _check(results: list[dict[str, object]], count: int, dtype: str, op: str) -> None:
    size = len(results)
    for rank, got in enumerate(results):
        assert got["backend"] == "levels"
        assert_reduced(got["all_reduce"], [_data(r, count, dtype) for r in range(size)], op, what="all_reduce")
        assert np.array_equal(got["all_reduce"], results[0]["all_reduce"]), "every rank ends with the same bits"
        for root in {0, size - 1, size // 2}:
            assert np.array_equal(got[f"broadcast {root}"], _data(root, count, dtype, 1))
            if rank == root:
                assert_reduced(got[f"reduce {root}"], [_data(r, count, dtype, 2) for r in range(size)], op)
            else:
                assert np.array_equal(got[f"reduce {root}"], _data(rank, count, dtype, 2)), "left as it was"
        for r, block in enumerate(got["all_gather"]):
            assert np.array_equal(block, _data(r, count, dtype, 3))
        inputs = [_data(r, count, dtype, 4 + rank) for r in range(size)]
        assert_reduced(got["reduce_scatter"], inputs, op, what="reduce_scatter")


@pytest.mark.timeout(600)
@settings(max_examples=examples(20), deadline=None)
@given(
    nodes=NODES,
    count=st.sampled_from(COUNTS),
    dtype=st.sampled_from(("float64", "float32", "int32")),
    op=st.sampled_from(OPS),
)
def test_every_collective_over_two_levels_gives_what_numpy_computes(nodes, count, dtype, op):
    if dtype == "int32" and op == "avg":
        op = "sum"
    results = run_world(sum(nodes), _every_collective, count, dtype, op, nodes=nodes, timeout=20)
    _check(results, count, dtype, op)


@pytest.mark.parametrize("nodes", [[2, 2], [3, 1], [1, 2, 3]])
def test_bfloat16_and_large_tensors_on_the_sharded_path(nodes):
    count = 3 * SMALL_BYTES // 2 + 3  # past the leaders' path in bfloat16, not a multiple of any node size

    def step() -> tuple[np.ndarray, np.ndarray]:
        x = np.full(count, get_rank() + 1, np.float32)
        all_reduce(x)
        from ml_dtypes import bfloat16

        y = (np.arange(count) % 7 + get_rank()).astype(bfloat16)
        all_reduce(y, "max")
        return x, y.astype(np.float32)

    size = sum(nodes)
    for x, y in run_world(size, step, nodes=nodes):
        assert (x == size * (size + 1) / 2).all()
        assert np.array_equal(y, (np.arange(count) % 7 + size - 1).astype(np.float32))


def test_a_large_all_reduce_goes_in_pieces_each_with_its_three_steps(monkeypatch):
    from ferrodist.collectives._levels import steps

    monkeypatch.setattr(steps, "PIECE_BYTES", 1024)  # 128 float64 per piece
    monkeypatch.setattr(steps, "SMALL_BYTES", 64)
    count = 128 * 5 + 3 * 2 + 1  # five pieces, a shorter one, and a tail for the leaders
    nodes = Nodes(((0, 1), (2, 3)))
    for rank in range(4):
        plan = steps.plan_steps(nodes, rank, False, "all_reduce", float64, count, ReduceOp.AVG)
        pieces = [s.data.count for s in plan.steps if s.level == "node" and s.operation == "reduce_scatter"]
        assert pieces == [128] * 5 + [6], str(plan)
        across = [s for s in plan.steps if s.level == "across"]
        assert [s.ranks for s in across] == [(rank % 2, 2 + rank % 2)] * 7  # a stream per local rank
        assert across[-1].data == steps.Span("x", count - 1, 1)  # the tail, by the pairs

    def step() -> np.ndarray:
        x = _data(get_rank(), count, "float64")
        all_reduce(x, "avg")
        return x

    results = run_world(4, step, nodes=[2, 2])
    for x in results:
        assert_reduced(x, [_data(r, count, "float64") for r in range(4)], "avg")
        assert np.array_equal(x, results[0])


@pytest.mark.parametrize(
    ("nodes", "count", "path"), [([2, 2], 100, "pairs"), ([2, 2], 3000, "leaders"), ([2, 1], 100, "leaders")]
)
@pytest.mark.parametrize("arena", [False, True])
def test_small_all_reduces_go_by_pairs_up_to_16_kib_on_equal_nodes(nodes, count, path, arena):
    from ferrodist.collectives._levels.steps import plan_steps

    places = Nodes.from_places([(k, j) for k, n in enumerate(nodes) for j in range(n)])
    for rank in range(sum(nodes)):
        plan = plan_steps(places, rank, arena, "all_reduce", float64, count, ReduceOp.SUM)
        said = [(s.level, s.operation, s.algorithm) for s in plan.steps]
        inside = "arena" if arena else "ring"
        if path == "pairs":
            assert said == [("node", "all_reduce", inside), ("across", "all_reduce", "swap")], str(plan)
            assert plan.steps[1].ranks == (rank % 2, 2 + rank % 2)
        else:
            leader = places.place(rank)[1] == 0
            middle = [("across", "all_reduce", "swap")] if leader else []
            alone = len(places.members[places.place(rank)[0]]) == 1
            ends = [] if alone else [("node", "reduce", "arena" if arena else "tree")]
            tail = [] if alone else [("node", "broadcast", "arena" if arena else "tree")]
            assert said == ends + middle + tail, str(plan)

    def step() -> np.ndarray:
        x = np.full(count, get_rank() + 1.0)
        all_reduce(x)
        return x

    size = sum(nodes)
    assert all((x == size * (size + 1) / 2).all() for x in run_world(size, step, nodes=nodes))


def test_the_plan_says_levels_and_subgroups_stay_flat(capsys, monkeypatch):
    monkeypatch.setenv("FERRODIST_DEBUG", "route")

    def step() -> tuple[str, str]:
        x = np.ones(4)
        all_reduce(x)
        pair = new_group([0, 1])
        if get_rank() < 2:
            y = np.ones(4)
            all_reduce(y, group=pair)
        return str(default_group()._route.levels), get_backend(pair if get_rank() < 2 else None)

    said = run_world(4, step, nodes=[2, 2])
    assert said[0][0] == ("two levels: node 0: ranks [0, 1], node 1: ranks [2, 3]; this rank is local rank 0 of node 0")
    assert said[0][1] == "simulated" and said[3][1] == "levels"
    out = capsys.readouterr().out
    assert "group world: all_reduce float64 x4 SUM -> levels" in out
    assert "-> recursive_doubling" in out  # the pair's call


def test_enable_two_levels_refuses_what_does_not_fit():
    inner = SimulatedTransport.create_group(2)

    def step() -> list[str]:
        said = []
        rank = get_rank()
        for kwargs in (
            {"places": [(0, 0), (0, 1)]},  # two ranks listed, the world has three
            {"places": [(0, 0), (0, 1), (1, 0)], "node_transport": None if rank < 2 else inner[0]},
            {"node_transport": inner[0]},  # a transport without places
        ):
            try:
                enable_two_levels(**kwargs)
            except InvalidArgument as exc:
                said.append(str(exc))
        pair = new_group([0, 1])
        try:
            if rank < 2:
                enable_two_levels(pair)
        except InvalidArgument as exc:
            said.append(str(exc))
        return said

    said = run_world(3, step)
    for rank in range(3):  # every rank refuses, naming the rank the places do not fit
        assert "places lists 2 ranks, the world has 3; every rank stays flat" in said[rank][0]
        assert (
            "local rank 0 of the 2 ranks of node 0: node_transport must be that rank of 2, not None; every rank stays"
            in said[rank][1]
        )
        assert "node_transport= needs places=" in said[rank][2]
    assert said[2][1].startswith("rank 2: enable_two_levels: rank 0: this rank is local rank 0")
    assert "only the world group runs over two levels" in said[0][3]
    assert len(said[2]) == 3


def _failing(fault_rank: int, fault: str, count: int, start: threading.Barrier) -> object:
    """Call all_reduce; on ``fault_rank``, ``fault`` instead; then one more call. Every rank
    starts once all have left ``enable_two_levels`` (a failure of a call aborts the group
    for a rank still in an earlier call too)."""
    start.wait(10)
    rank = get_rank()
    x = np.ones(count)
    outcome: list[object] = []
    for _ in range(2):
        started = time.monotonic()
        try:
            if rank == fault_rank and fault == "absent":
                time.sleep(3.5)
                raise RuntimeError("this rank stayed away")
            if rank == fault_rank and fault == "dies":
                time.sleep(0.2)
                raise RuntimeError(f"rank {rank} dies")
            if rank == fault_rank and fault == "mismatch":
                all_reduce(np.ones(count + 1))
            else:
                all_reduce(x)
            outcome.append(("ok", time.monotonic() - started))
        except FerrodistError as exc:
            outcome.append((exc, time.monotonic() - started))
        except RuntimeError:
            if fault == "dies":
                raise
            return outcome
    return outcome


def _outcomes(fault_rank: int, fault: str, count: int, timeout: float) -> dict[int, object]:
    """Every rank's outcomes of ``_failing`` on 2 simulated nodes of 2 ranks."""
    seen: dict[int, object] = {}
    start = threading.Barrier(4)

    def step() -> None:
        seen[get_rank()] = _failing(fault_rank, fault, count, start)

    try:
        run_world(4, step, nodes=[2, 2], timeout=timeout)
    except RuntimeError as exc:
        assert fault == "dies" and f"rank {fault_rank} dies" in str(exc)
    return seen


@pytest.mark.parametrize("count", [10, SMALL_BYTES // 8 * 2])
def test_a_rank_that_dies_fails_every_rank_naming_it_and_its_node(count):
    """Rank 3 dies (its transports close, as a killed process's sockets do) instead of
    calling; on the leaders' path and on the sharded one."""
    seen = _outcomes(3, "dies", count, 5)
    for rank in (0, 1, 2):
        (first, took), (second, _) = seen[rank]
        assert isinstance(first, FerrodistError), (rank, first)
        assert took < 5 + 1.5, (rank, took)
        assert "rank 3" in str(first), (rank, str(first))
        assert isinstance(second, GroupAborted), (rank, second)
    assert any("rank 3 runs on node 1 with ranks [2, 3]" in str(seen[r][0][0]) for r in (0, 1, 2)), [
        str(seen[r][0][0]) for r in (0, 1, 2)
    ]


def test_an_error_inside_a_node_names_every_rank_by_its_global_number():
    """The node's transport numbers its ranks 0..L-1: its messages reach the caller with the
    global numbers (on node 1 of ranks [2, 3], local rank 1 is rank 3; rank 1 is alive on
    node 0 and must not be named)."""

    class World:
        rank = 2

    levels = Levels(Nodes.from_places([(0, 0), (0, 1), (1, 0), (1, 1)]), World(), 0, None)  # type: ignore[arg-type]
    lost = PeerLost("rank 1 went away without closing its transport (it exited, crashed or was killed)", peer=1, rank=0)
    lost = lost.with_context("rank 0: a peer was lost during a shared-memory collective")
    error = levels._globally(lost)
    assert str(error) == (
        "inside node 1 (ranks [2, 3]): rank 2: a peer was lost during a shared-memory collective: rank 3 went away "
        "without closing its transport (it exited, crashed or was killed)"
    )
    assert (error.peer, error.rank) == (3, 2)
    # Local rank 0 (rank 2) left after a failure of the world, which it passes on in global
    # ranks: rank 1 of node 0 was lost. Those words and that culprit stay as they are.
    world_failure = "rank 0: barrier #4 on group world (group rank 0 of 4): rank 1 went away (rank 1 runs on node 0)"
    passed = PeerLost(f"rank 0 closed its transport after a failure there: {world_failure}", peer=1, rank=1)
    passed.told_by = 0  # type: ignore[attr-defined]
    levels = Levels(Nodes.from_places([(0, 0), (0, 1), (1, 0), (1, 1)]), type("W", (), {"rank": 3})(), 0, None)  # type: ignore[arg-type]
    error = levels._globally(passed)
    assert (
        str(error)
        == f"inside node 1 (ranks [2, 3]): rank 2 closed its transport after a failure there: {world_failure}"
    )
    assert (error.peer, error.rank) == (1, 3)
    assert in_global_ranks("ranks [0, 1] did not map it; group rank 1 and local rank 0 stay; rank 7", [4, 6]) == (
        "ranks [4, 6] did not map it; group rank 1 and local rank 0 stay; rank 7"
    )


def test_a_rank_that_stays_away_times_out_every_rank_within_the_deadline_and_is_blamed():
    seen = _outcomes(1, "absent", 10, 2)
    for rank in (0, 2, 3):
        (first, took), (second, _) = seen[rank]
        assert isinstance(first, CollectiveTimeout), (rank, first)
        assert took < 2 + 1.5, (rank, took)
        assert 1 in first.waiting_for or "rank 1" in str(first), (rank, str(first))
        assert isinstance(second, GroupAborted)


def test_ranks_in_different_calls_raise_a_mismatch_on_every_rank():
    seen = _outcomes(2, "mismatch", 10, 5)
    for rank in range(4):
        (first, took), _ = seen[rank]
        assert isinstance(first, FerrodistError), (rank, first)
        assert took < 5, (rank, took)
    assert any(isinstance(seen[r][0][0], CollectiveMismatch) for r in range(4))
