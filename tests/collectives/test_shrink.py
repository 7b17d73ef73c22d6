"""Shrinking a failed group to its live members, on in-process worlds: the survivors agree
on one set of members (a slow rank is in every survivor's group or told it is out), the new
group computes exact results over the same transport, and the errors say who and why."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

import ferrodist.collectives as dist
from ferrodist.core import CollectiveTimeout, Excluded, FerrodistError, InvalidArgument, InvalidRank
from ferrodist.testing import run_world


def _fail_world(dead: set[int]) -> None:
    """Ranks in ``dead`` close their transport (as a killed process's connections end);
    the others' next all_reduce fails."""
    world = dist.default_group()
    if world.rank in dead:
        world.transport.close()
        return
    with pytest.raises(FerrodistError):
        world.all_reduce(np.ones(4))


@pytest.mark.parametrize(("size", "dead"), [(2, {1}), (3, {0}), (4, {2}), (4, {0, 3}), (5, {1, 2})])
def test_survivors_of_lost_ranks_agree_and_compute_exactly(size, dead):
    def rank_main():
        _fail_world(dead)
        world = dist.default_group()
        if world.rank in dead:
            return None
        started = time.monotonic()
        group = world.shrink(timeout=20)
        took = time.monotonic() - started
        x = np.full(1000, float(world.rank + 1))
        group.all_reduce(x)
        return group.ranks, group.rank, group.size, x[0], took

    results = run_world(size, rank_main)
    live = tuple(r for r in range(size) if r not in dead)
    expected_sum = float(sum(r + 1 for r in live))
    for rank, result in enumerate(results):
        if rank in dead:
            continue
        ranks, group_rank, group_size, total, took = result
        assert ranks == live and group_rank == live.index(rank) and group_size == len(live)
        assert total == expected_sum
        assert took < 5.0  # every lost rank is gone: no round waits out its window


def test_a_silent_rank_is_left_out_and_told_so_when_it_comes_back():
    """Rank 3 stops (alive, connection open) past the window: the others shrink without it;
    when it calls shrink itself, it raises Excluded naming the group they made."""

    def rank_main():
        world = dist.default_group()
        if world.rank == 3:
            time.sleep(3.0)  # stopped: the others' call fails and their shrink passes over it
            with pytest.raises(Excluded) as caught:
                world.shrink(timeout=10, window=0.5)
            return caught.value.survivors
        with pytest.raises(FerrodistError):
            world.all_reduce(np.ones(4), timeout=0.5)
        group = world.shrink(timeout=10, window=1.0)
        x = np.full(3, 2.0**world.rank)
        group.all_reduce(x)
        return group.ranks, x[0]

    results = run_world(4, rank_main)
    assert results[:3] == [((0, 1, 2), 7.0)] * 3
    assert results[3] == (0, 1, 2)


@pytest.mark.parametrize("seed", range(12))
def test_a_rank_arriving_around_the_window_is_in_every_group_or_excluded(seed):
    """Survivors enter shrink at staggered times and one rank arrives near the end of their
    windows: whatever the timing, every rank that returns holds the same members, and the
    late rank is among them or raises Excluded (never in one survivor's group only)."""
    rng = random.Random(seed)
    window = 0.4
    delays = [rng.uniform(0, 0.3) for _ in range(4)]
    late = rng.randrange(4)
    delays[late] = rng.uniform(0.2, 0.9)

    def rank_main():
        world = dist.default_group()
        time.sleep(delays[world.rank])
        try:
            group = world.shrink(timeout=15, window=window)
        except Excluded as exc:
            return ("excluded", exc.survivors)
        x = np.full(5, float(10**world.rank))
        group.all_reduce(x)
        return ("in", group.ranks, x[0])

    results = run_world(4, rank_main)
    groups = {result[1] for result in results if result[0] == "in"}
    assert len(groups) == 1, results
    (members,) = groups
    for rank, result in enumerate(results):
        if rank in members:
            assert result == ("in", members, float(sum(10**r for r in members))), results
        else:
            assert result == ("excluded", members), results
    assert len(members) >= 3  # a majority of the four


def test_a_rank_that_finds_no_majority_raises_excluded_at_its_deadline():
    """Two ranks, one stopped (alive, its connection open): the other cannot tell a stopped
    rank from one that goes on alone, so it does not go on alone."""

    def rank_main():
        world = dist.default_group()
        if world.rank == 1:
            time.sleep(2.5)
            return None
        started = time.monotonic()
        with pytest.raises(Excluded, match="no majority"):
            world.shrink(timeout=1.5, window=0.5)
        return time.monotonic() - started

    took = run_world(2, rank_main)[0]
    assert 1.5 <= took < 4.0


def test_exclude_drops_the_named_ranks_of_a_healthy_group():
    def rank_main():
        world = dist.default_group()
        if world.rank == 1:
            return None  # named in exclude: takes no part
        group = world.shrink(exclude=[1], timeout=10)
        x = np.array([float(world.rank)])
        group.all_reduce(x)
        return group.ranks, x[0]

    results = run_world(3, rank_main)
    assert results[0] == results[2] == ((0, 2), 2.0)


def test_exclude_fails_on_every_rank_when_another_member_is_missing():
    def rank_main():
        world = dist.default_group()
        if world.rank == 3:
            world.transport.close()
            return None
        if world.rank == 1:
            return None
        with pytest.raises(CollectiveTimeout, match=r"leaves ranks \[3\] in"):
            world.shrink(exclude=[1], timeout=10)
        return True

    assert run_world(4, rank_main) == [True, None, True, None]


def test_bad_arguments_are_refused_before_any_message():
    def rank_main():
        world = dist.default_group()
        with pytest.raises(InvalidRank, match="this rank is among them"):
            world.shrink(exclude=[world.rank])
        with pytest.raises(InvalidRank, match="outside it"):
            world.shrink(exclude=[7])
        with pytest.raises(InvalidArgument, match="window"):
            world.shrink(window=0)
        return True

    assert run_world(2, rank_main) == [True, True]


def test_a_shrunk_group_shrinks_again_and_keeps_its_subgroups_apart():
    def rank_main():
        world = dist.default_group()
        _fail_world({3})
        if world.rank == 3:
            return None
        first = world.shrink(timeout=10)
        if world.rank == 2:
            first.transport.close()
            return None
        with pytest.raises(FerrodistError):
            first.all_reduce(np.ones(2))
        second = first.shrink(timeout=10)
        x = np.array([1.0])
        second.all_reduce(x)
        world_again = np.array([1.0])
        with pytest.raises(FerrodistError):  # the first world stays aborted
            world.all_reduce(world_again)
        return second.ranks, second.name, x[0]

    results = run_world(4, rank_main)
    assert results[0] == results[1] == ((0, 1), "world/0.1.2/0.1", 2.0)


def test_the_survivors_of_a_lost_node_shrink_a_two_level_world():
    """Two simulated nodes of two ranks; node 1's ranks leave at once: node 0's shrink."""

    def rank_main():
        _fail_world({2, 3})
        world = dist.default_group()
        if world.rank in (2, 3):
            return None
        group = world.shrink(timeout=10)
        x = np.array([float(world.rank + 1)])
        group.all_reduce(x)
        return group.ranks, x[0]

    assert run_world(4, rank_main, nodes=[2, 2]) == [((0, 1), 3.0), ((0, 1), 3.0), None, None]
