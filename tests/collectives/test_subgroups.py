"""Groups made by their members alone (``ProcessGroup.subgroup``, what the torch backend
makes for every group after the default one): the parent's transport, a channel of their
own, no call of the ranks outside them."""

from __future__ import annotations

import numpy as np
import pytest

import ferrodist.collectives as dist
from ferrodist.collectives import _group
from ferrodist.core import InvalidArgument, InvalidRank
from ferrodist.testing import run_world


def test_a_subgroup_is_made_by_its_members_only_over_the_parents_transport():
    def rank_main():
        world = dist.default_group()
        rank = world.rank
        if rank == 2:  # not a member: makes nothing, calls nothing on it
            dist.all_reduce(np.array([20.0]))
            dist.barrier()
            return None
        sub = world.subgroup([0, 1], name="pair")
        x = np.array([rank + 1.0])
        sub.all_reduce(x)
        y = np.array([10.0 * rank])
        dist.all_reduce(y)  # the world's calls are numbered apart from the subgroup's: 0 + 10 + 20
        dist.barrier()
        return sub.transport is world.transport, sub.size, float(x[0]), float(y[0])

    results = run_world(3, rank_main)
    assert results[:2] == [(True, 2, 3.0, 30.0)] * 2 and results[2] is None


def test_two_subgroups_over_the_same_ranks_keep_their_calls_apart():
    def rank_main():
        world = dist.default_group()
        a = world.subgroup([0, 1], name="a")
        b = world.subgroup([0, 1], name="b")
        x, y = np.array([1.0]), np.array([100.0])
        work = a.all_reduce(x, async_op=True)
        b.all_reduce(y)
        work.wait(10)
        return float(x[0]), float(y[0])

    assert run_world(2, rank_main) == [(2.0, 200.0)] * 2


def test_a_subgroup_names_what_is_wrong(monkeypatch):
    dist.init_process_group("simulated")
    try:
        world = dist.default_group()
        with pytest.raises(InvalidRank, match=r"subgroup too big: ranks \[0, 1\] must be members of group"):
            world.subgroup([0, 1], name="too big")
        monkeypatch.setattr(_group, "subgroup_channel", lambda name: 1 << 30 | 7)  # every name, one channel
        first = world.subgroup([0], name="a")
        with pytest.raises(InvalidArgument, match="subgroup b: its channel is taken by subgroup a"):
            world.subgroup([0], name="b")
        first._shutdown()  # a destroyed subgroup gives its channel back
        second = world.subgroup([0], name="b")
        x = np.array([5.0])
        second.all_reduce(x)
        assert x[0] == 5.0
    finally:
        dist.destroy_process_group()
