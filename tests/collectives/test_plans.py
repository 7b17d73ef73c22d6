"""Algorithm plans are data: check their invariants for every group size up to 33."""

from __future__ import annotations

import pytest

from ferrodist.collectives._algorithms.plans import (
    binomial_tree,
    chunk_layout,
    dissemination_peers,
    doubling_plan,
    ring_plan,
)
from ferrodist.collectives._algorithms.select import SMALL_MESSAGE_BYTES, all_reduce_algorithm
from ferrodist.core import InvalidArgument

SIZES = list(range(1, 34))


@pytest.mark.parametrize("count", [0, 1, 2, 7, 64, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_chunk_layout_covers_everything_once(count, parts):
    counts, offsets = chunk_layout(count, parts)
    assert sum(counts) == count
    assert max(counts) - min(counts) <= 1
    assert offsets == tuple(sum(counts[:i]) for i in range(parts))


@pytest.mark.parametrize("size", SIZES)
def test_ring_steps_pair_up_and_every_rank_owns_one_chunk(size):
    plans = [ring_plan(100, size, r) for r in range(size)]
    for r, plan in enumerate(plans):
        right = plans[plan.right]
        assert right.left == r
        for step in range(size - 1):
            # What r sends at a step is exactly what its right neighbour receives then.
            assert plan.reduce_steps[step][0] == right.reduce_steps[step][1]
            assert plan.gather_steps[step][0] == right.gather_steps[step][1]
        # The chunk received at the last reduce step is the one this rank ends up owning.
        if size > 1:
            assert plan.reduce_steps[-1][1] == plan.owned
            assert plan.gather_steps[0][0] == plan.owned
    assert sorted(p.owned for p in plans) == list(range(size))


@pytest.mark.parametrize("size", SIZES)
def test_ring_reduces_each_chunk_once_per_rank(size):
    for chunk in range(size):
        contributors = set()
        for r in range(size):
            plan = ring_plan(10, size, r)
            if any(recv == chunk for _, recv in plan.reduce_steps):
                contributors.add(r)
        # Every rank except the chunk's first sender adds into it exactly once.
        assert len(contributors) == size - 1


@pytest.mark.parametrize("size", SIZES)
def test_doubling_partners_are_mutual_and_folds_pair_up(size):
    plans = [doubling_plan(size, r) for r in range(size)]
    for r, plan in enumerate(plans):
        if plan.fold_to is not None:
            assert plans[plan.fold_to].fold_from == r
            assert plan.partners == ()
        for step, partner in enumerate(plan.partners):
            assert plans[partner].partners[step] == r
    participants = [p for p in plans if p.fold_to is None]
    assert len(participants) & (len(participants) - 1) == 0  # a power of two


@pytest.mark.parametrize("size", SIZES)
def test_binomial_tree_is_a_tree_for_every_root(size):
    for root in range(size):
        plans = [binomial_tree(size, root, r) for r in range(size)]
        assert plans[root].parent is None
        for r, plan in enumerate(plans):
            if r != root:
                assert r in plans[plan.parent].children
            for child in plan.children:
                assert plans[child].parent == r
        # Depth is at most ceil(log2(size)).
        for r in range(size):
            depth, node = 0, r
            while plans[node].parent is not None:
                node, depth = plans[node].parent, depth + 1
            assert depth <= max(0, (size - 1).bit_length())


@pytest.mark.parametrize("size", SIZES)
def test_dissemination_rounds_reach_everyone(size):
    informed = [{r} for r in range(size)]
    for rnd in range(len(dissemination_peers(size, 0))):
        new = [set(s) for s in informed]
        for r in range(size):
            to, _ = dissemination_peers(size, r)[rnd]
            new[to] |= informed[r]
        informed = new
    assert all(s == set(range(size)) for s in informed)


def test_algorithm_choice_by_size_and_override():
    assert all_reduce_algorithm(16, 4, None, rank=0) == "recursive_doubling"
    assert all_reduce_algorithm(SMALL_MESSAGE_BYTES + 1, 4, None, rank=0) == "ring"
    assert all_reduce_algorithm(16, 4, "ring", rank=0) == "ring"
    with pytest.raises(InvalidArgument, match="unknown"):
        all_reduce_algorithm(16, 4, "star", rank=0)
