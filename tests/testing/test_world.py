"""ferrodist.testing: run_world, the references and the strategies themselves."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferrodist.collectives as dist
from ferrodist.core import CollectiveTimeout, InvalidArgument, PeerLost, ReduceOp, dtype
from ferrodist.testing import (
    assert_reduced,
    reduce_values,
    reduction_tolerance,
    ref_all_to_all,
    ref_reduce_scatter,
    run_world,
)
from ferrodist.testing import strategies as fst


def test_results_come_back_in_rank_order_with_args_and_kwargs():
    def rank_main(base, *, scale):
        return base + scale * dist.get_rank()

    assert run_world(4, rank_main, 10, scale=2) == [10, 12, 14, 16]


def test_the_first_failure_is_re_raised_with_its_rank_not_its_echoes():
    def rank_main():
        if dist.get_rank() == 2:
            time.sleep(0.1)
            raise KeyError("the real cause")
        dist.barrier(timeout=30)  # the others wait for rank 2 and then lose it

    with pytest.raises(KeyError, match="the real cause") as info:
        run_world(4, rank_main)
    assert "raised on rank 2 of 4 in run_world (ranks [0, 1, 3] failed after it)" in info.value.__notes__


def test_peer_lost_is_reported_when_it_is_the_only_failure():
    def rank_main():
        if dist.get_rank() == 0:
            dist.destroy_process_group()
            dist.init_process_group("simulated")
            return None
        dist.recv(np.zeros(1), src=0, timeout=30)

    with pytest.raises(PeerLost):
        run_world(2, rank_main)


def test_a_stuck_rank_is_named_after_run_timeout():
    def rank_main():
        if dist.get_rank() == 1:
            time.sleep(3)

    with pytest.raises(CollectiveTimeout, match=r"ranks \[1\] of 2 were still running") as info:
        run_world(2, rank_main, run_timeout=0.3)
    assert info.value.waiting_for == (1,)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_world_size_must_be_a_positive_int(bad):
    with pytest.raises(InvalidArgument):
        run_world(bad, lambda: None)


def test_references_are_naive_and_right():
    a = np.array([1, 2, 3], np.int8)
    b = np.array([127, 5, -3], np.int8)
    np.testing.assert_array_equal(reduce_values([a, b], "sum"), [-128, 7, 0])
    np.testing.assert_array_equal(reduce_values([a, b], ReduceOp.MIN), [1, 2, -3])
    blocks = [[np.array([r * 10 + i]) for i in range(3)] for r in range(3)]
    np.testing.assert_array_equal(ref_reduce_scatter(blocks, "sum")[1], [1 + 11 + 21])
    assert ref_all_to_all(blocks)[2][1][0] == 12


def test_assert_reduced_catches_errors_beyond_the_bound():
    values = [np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)]
    assert_reduced(np.array([4.0, 6.0], np.float32), values, "sum")
    bound = reduction_tolerance(values, "sum")
    assert 0 < bound[0] < 1e-5
    with pytest.raises(AssertionError, match="element 1"):
        assert_reduced(np.array([4.0, 6.001], np.float32), values, "sum")
    with pytest.raises(AssertionError):
        assert_reduced(np.array([4, 7], np.int32), [np.array([1, 3], np.int32), np.array([3, 3], np.int32)], "sum")
    with pytest.raises(AssertionError, match="float64"):
        assert_reduced(np.array([4.0, 6.0]), values, "sum")


@settings(max_examples=30)
@given(data=st.data())
def test_strategies_make_what_they_promise(data):
    size = data.draw(fst.world_sizes(1, 8))
    assert 1 <= size <= 8
    dt = data.draw(fst.dtypes())
    op = data.draw(fst.reduce_ops(dt))
    assert op in dt.ops
    shape = data.draw(fst.shapes(max_elements=20))
    assert np.prod(shape) <= 20
    inputs = data.draw(fst.world_inputs(size, dt, shape))
    assert len(inputs) == size
    assert all(x.dtype == dt.numpy and x.shape == shape and x.flags.c_contiguous for x in inputs)
    if dt.is_floating:
        assert all(np.isfinite(x.astype(np.float64)).all() for x in inputs)
    assert 0 <= data.draw(fst.roots(size)) < size
    members = data.draw(fst.subgroups(size))
    assert members == sorted(set(members)) and members and members[-1] < size
    floats = data.draw(fst.dtypes(kinds=["float"]))
    assert dtype(floats).is_floating
