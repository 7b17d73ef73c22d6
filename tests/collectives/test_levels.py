"""Two-level plans (shared memory inside a node, the network between) as values: for every
shape of nodes x ranks, uneven nodes and any numbering of the ranks included, the three steps
of the sharded all_reduce give every rank the flat all_reduce's result, each node sends each
shard across nodes once, and in every collective's step plan the ranks of each step agree on
it and meet the steps they share in one order (what keeps a two-level call from hanging or
taking another step's messages)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import examples
from ferrodist.collectives._levels.plan import LevelsPlan, Nodes, levels_plan
from ferrodist.collectives._levels.steps import OPERATIONS, SMALL_BYTES, Step, plan_steps, spans
from ferrodist.core import InvalidArgument, ReduceOp, float64

SIZES = st.lists(st.integers(1, 4), min_size=1, max_size=5)  # ranks per node


@st.composite
def placements(draw: st.DrawFn) -> Nodes:
    """Nodes of the drawn sizes, the global ranks dealt to them in any order."""
    sizes = draw(SIZES)
    ranks = draw(st.permutations(range(sum(sizes))))
    places: list[tuple[int, int]] = [(0, 0)] * len(ranks)
    it = iter(ranks)
    for node, size in enumerate(sizes):
        for local in range(size):
            places[next(it)] = (node, local)
    return Nodes.from_places(places)


def run_plans(plans: list[LevelsPlan], inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Execute the three steps the plans describe, with numpy: what each rank ends with."""
    shards = len(plans[0].counts)
    # 1. inside each node: the owner of shard s on a node gets the node's sum of shard s
    partial: dict[tuple[int, int], np.ndarray] = {}
    for plan in plans:
        for s in range(shards):
            owner = plan.owners[s]
            piece = inputs[plan.rank][plan.span(s)]
            partial[(owner, s)] = partial.get((owner, s), 0) + piece
    # 2. across nodes: the owners of a shard all_reduce it, each with its group
    total: dict[tuple[int, int], np.ndarray] = {}
    for plan in plans:
        for s, group in zip(plan.owned, plan.across, strict=True):
            assert plan.rank in group
            total[(plan.rank, s)] = sum(partial[(peer, s)] for peer in group)
    # 3. inside each node: every rank gathers every shard from its owner on the node
    out = []
    for plan in plans:
        result = np.empty_like(inputs[plan.rank])
        for s in range(shards):
            result[plan.span(s)] = total[(plan.owners[s], s)]
        out.append(result)
    return out


@settings(max_examples=examples(200))
@given(nodes=placements(), count=st.integers(0, 40), seed=st.integers(0, 2**32 - 1))
def test_the_three_steps_give_every_rank_the_flat_all_reduce(nodes, count, seed):
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-1000, 1000, count) for _ in range(nodes.world_size)]
    plans = [levels_plan(nodes, count, r) for r in range(nodes.world_size)]
    expected = np.sum(inputs, axis=0) if inputs else None
    for rank, got in enumerate(run_plans(plans, inputs)):
        np.testing.assert_array_equal(got, expected, err_msg=f"rank {rank} of {nodes}")


@settings(max_examples=examples(200))
@given(nodes=placements(), count=st.integers(0, 1000))
def test_each_shard_has_one_owner_per_node_and_a_group_of_its_own(nodes, count):
    plans = [levels_plan(nodes, count, r) for r in range(nodes.world_size)]
    n = len(nodes.members)
    groups: dict[int, tuple[int, ...]] = {}
    for plan in plans:
        assert plan.node_ranks == nodes.members[plan.node] and plan.counts == plans[0].counts
        assert sum(plan.counts) == count and len(plan.counts) == max(len(m) for m in nodes.members)
        for s, group in zip(plan.owned, plan.across, strict=True):
            assert plan.owners[s] == plan.rank
            assert [nodes.place(peer)[0] for peer in group] == list(range(n))  # one owner per node, node order
            assert groups.setdefault(s, group) == group  # every owner names the same group
    assert sorted(groups) == list(range(len(plans[0].counts)))
    assert len(set(groups.values())) == len(groups)  # distinct shards, distinct groups: they can run at once
    # a node's ranks own every shard once between them, as evenly as its size allows
    for members in nodes.members:
        owned = sorted(s for r in members for s in plans[r].owned)
        assert owned == list(range(len(plans[0].counts)))
        loads = [len(plans[r].owned) for r in members]
        assert max(loads) - min(loads) <= 1


@settings(max_examples=examples(100))
@given(nodes=placements(), count=st.integers(1, 10_000))
def test_a_node_sends_the_tensor_across_once_and_no_rank_more_than_a_flat_ring(nodes, count):
    n, p = len(nodes.members), nodes.world_size
    plans = [levels_plan(nodes, count, r) for r in range(p)]
    for members in nodes.members:
        sent = sum(plans[r].network_elements() for r in members)
        assert sent == pytest.approx(2 * (n - 1) / n * count)
    flat_ring = 2 * (p - 1) / p * count
    assert max(plan.network_elements() for plan in plans) <= flat_ring + 1e-9


def test_a_plan_says_what_it_does():
    nodes = Nodes.from_places([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)])
    assert str(nodes) == "node 0: ranks [0, 1, 2], node 1: ranks [3, 4]"
    assert str(levels_plan(nodes, 10, 3)) == (
        "rank 3 (node 1, local rank 0 of 2): 3 shards; reduce-scatter and all-gather with ranks [3, 4]; "
        "across nodes: shard 0 with ranks [0, 3], 2 with ranks [2, 3]"
    )


@pytest.mark.parametrize(
    ("places", "message"),
    [
        ([], "at least one rank"),
        ([(0, 0), (0, 0)], "ranks 0 and 1 both say they are local rank 0 of node 0"),
        ([(0, 0), (0, 2)], "node 0 has local ranks \\[0, 2\\], not 0 to 1"),
        ([(0, 0), (2, 0)], "no rank is on node 1, yet ranks are on node 2"),
        ([(0, -1)], "rank 0 is at node 0, local rank -1"),
    ],
)
def test_placements_that_do_not_add_up_are_refused(places, message):
    with pytest.raises(InvalidArgument, match=message):
        Nodes.from_places(places)


def test_every_rank_learns_the_same_nodes_from_the_launcher_or_the_hosts():
    import ferrodist.collectives as dist
    from ferrodist.collectives._start.levels import discover_nodes
    from ferrodist.testing import run_world
    from ferrodist.transport import this_host

    def body():
        group, r = dist.default_group(), dist.get_rank()
        return (
            discover_nodes(group, env={"GROUP_RANK": str(r // 2)}),  # ferrodist run, torchrun
            discover_nodes(group, env={"SLURM_NODEID": str(r % 2)}),  # nodes need not hold consecutive ranks
            discover_nodes(group, env={"NODE_RANK": "0"} if r else {}, host=f"host-{r // 3}"),  # one rank unplaced
            discover_nodes(group, env={}),  # no launcher: this machine's host, for every rank
        )

    for by_group, by_slurm, by_host, alone in run_world(4, body):
        assert by_group.members == ((0, 1), (2, 3))
        assert by_slurm.members == ((0, 2), (1, 3))
        assert by_host.members == ((0, 1, 2), (3,))  # the hosts decide when a rank has no node number
        assert alone.members == ((0, 1, 2, 3),)
    assert this_host().split("/", 1)[0]  # the host name, then the boot id


def test_the_ranks_on_a_host_count_every_node_that_runs_there():
    nodes = Nodes(((0, 1), (2, 3), (4,)), hosts=("a/boot", "a/boot", "b/boot"))
    assert [nodes.ranks_on_host(k) for k in range(3)] == [4, 4, 1]  # two nodes started on one machine
    assert Nodes(((0, 1), (2,))).ranks_on_host(0) == 2  # hosts unknown: the node's own


def _shared(step: Step) -> tuple[object, ...]:
    """What every rank of a step must say about it alike."""
    count = step.data.count if step.data is not None and step.algorithm != "exchange" else 0
    return (
        step.level,
        step.operation,
        step.algorithm,
        step.ranks,
        step.number,
        step.fingerprint,
        step.root,
        step.op,
        step.divisor,
        count,
    )


@settings(max_examples=examples(300))
@given(
    nodes=placements(),
    operation=st.sampled_from(OPERATIONS),
    count=st.sampled_from((1, 3, 100, 2000, SMALL_BYTES // 8 + 5)),
    op=st.sampled_from((ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX)),
    root_seed=st.integers(0, 1000),
    arena=st.booleans(),
)
def test_the_ranks_of_every_step_agree_on_it_and_meet_their_steps_in_one_order(
    nodes, operation, count, op, root_seed, arena
):
    size = nodes.world_size
    if size < 2 or len(nodes.members) < 2:
        return
    root = root_seed % size if operation in ("broadcast", "reduce") else None
    reduces = operation in ("all_reduce", "reduce", "reduce_scatter")
    plans = [plan_steps(nodes, r, arena, operation, float64, count, op if reduces else None, root) for r in range(size)]
    talks = [[s for s in plan.steps if s.level != "here"] for plan in plans]
    for r, steps in enumerate(talks):
        for step in steps:
            assert step.ranks[step.index] == r, str(plans[r])
            if step.level == "node":
                assert step.ranks == nodes.members[nodes.place(r)[0]]
            else:
                assert len({nodes.place(q)[0] for q in step.ranks}) == len(step.ranks), "one rank per node"
        for q in range(size):
            if q == r:
                continue
            mine = [_shared(s) for s in steps if q in s.ranks]
            theirs = [_shared(s) for s in talks[q] if r in s.ranks]
            assert mine == theirs, f"ranks {r} and {q} disagree:\n{plans[r]}\n{plans[q]}"
            for step in steps:  # an exchange receives from each peer what that peer sends
                if step.algorithm == "exchange" and q in step.ranks:
                    sent = next(s for s in talks[q] if _shared(s) == _shared(step)).data
                    assert sent is not None and step.parts[step.ranks.index(q)].count == sent.count
    for plan in plans:  # every span lies inside its buffer
        slots = dict(plan.scratch)
        for span in spans(plan):
            limit = slots[int(span.buffer.split()[1])] if span.buffer.startswith("scratch") else count
            assert 0 <= span.start and span.start + span.count <= limit, f"{span} in\n{plan}"
