"""Every collective on the simulated backend against the naive numpy references.

Example counts (CI profile, derandomized; FERRODIST_HYPOTHESIS_PROFILE=dev runs 5x, random):
- all_reduce: 4 examples for each (dtype, op) pair that applies (13 dtypes, 83 pairs) and
  each algorithm (ring, recursive doubling); the automatic choice is covered by the
  subgroup test and tests/collectives/test_api.py;
- reduce, reduce_scatter: 4 examples for each (dtype, op) pair;
- broadcast, all_gather, gather, scatter, all_to_all: 6 examples per dtype;
- subgroups: 40 examples drawing a collective, a subgroup, an op and a root.
World sizes 1..8; shapes from 0-d to 3-d, empty ones included, element counts not
divisible by the world size included; async_op drawn at random. Integer, bool, MIN
and MAX results must be exact; float SUM/AVG/PRODUCT within the bound stated in
``ferrodist.testing.reduction_tolerance``. Every rank's result must be bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferrodist.collectives as dist
from _helpers import examples
from ferrodist.core import ALL_DTYPES, ReduceOp
from ferrodist.testing import (
    assert_reduced,
    ref_all_gather,
    ref_all_to_all,
    ref_broadcast,
    ref_gather,
    ref_reduce,
    ref_scatter,
    run_world,
)
from ferrodist.testing.strategies import roots, shapes, subgroups, tensors, world_inputs, world_sizes

PAIRS = [(dt, op) for dt in ALL_DTYPES for op in sorted(dt.ops, key=lambda o: o.value)]
PAIR_IDS = [f"{d.name}-{o.name}" for d, o in PAIRS]
# Hypothesis tries the simplest values first; these orders make "simple" mean a real
# case (3 ranks, 37 elements: not divisible by the world size) instead of 1 rank and a
# 0-d array, so that even a few examples per (dtype, op) reach the interesting paths.
SIZES = st.sampled_from([3, 8, 5, 2, 1, 4, 7, 6])
SHAPES = st.one_of(st.sampled_from([(37,), (4, 5), (3,), (0,), ()]), shapes(max_elements=40))


def bounds(op):
    return {"low": -2.0, "high": 2.0} if op is ReduceOp.PRODUCT else {}


def finish(work):
    if work is not None:
        work.wait(10)


def assert_same_bits(results):
    first = np.asarray(results[0]).tobytes()
    for r, out in enumerate(results[1:], start=1):
        assert np.asarray(out).tobytes() == first, f"rank {r} disagrees with rank 0 bit for bit"


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=PAIR_IDS)
@settings(max_examples=examples(4))
@given(data=st.data(), size=SIZES, shape=SHAPES, async_op=st.booleans())
def test_all_reduce(dt, op, algorithm, data, size, shape, async_op):
    inputs = data.draw(world_inputs(size, dt, shape, **bounds(op)))

    def rank_main():
        x = inputs[dist.get_rank()].copy()
        finish(dist.all_reduce(x, op, async_op=async_op, algorithm=algorithm))
        return x

    results = run_world(size, rank_main)
    for r, out in enumerate(results):
        assert_reduced(out, inputs, op, what=f"rank {r}")
    assert_same_bits(results)


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=PAIR_IDS)
@settings(max_examples=examples(4))
@given(data=st.data(), size=SIZES, shape=SHAPES, async_op=st.booleans())
def test_reduce(dt, op, data, size, shape, async_op):
    inputs = data.draw(world_inputs(size, dt, shape, **bounds(op)))
    root = data.draw(roots(size))

    def rank_main():
        x = inputs[dist.get_rank()].copy()
        finish(dist.reduce(x, root, op, async_op=async_op))
        return x

    results = run_world(size, rank_main)
    expected = ref_reduce(inputs, root, op)
    for r, out in enumerate(results):
        if r == root:
            assert_reduced(out, inputs, op, what=f"root {r}")
        else:
            np.testing.assert_array_equal(out, expected[r], err_msg=f"rank {r} must keep its input")


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=PAIR_IDS)
@settings(max_examples=examples(4))
@given(data=st.data(), size=SIZES, shape=SHAPES, as_list=st.booleans(), async_op=st.booleans())
def test_reduce_scatter(dt, op, data, size, shape, as_list, async_op):
    # blocks[r][i]: rank r's contribution to rank i's output.
    blocks = [data.draw(world_inputs(size, dt, shape, **bounds(op))) for _ in range(size)]

    def rank_main():
        r = dist.get_rank()
        mine = [b.copy() for b in blocks[r]]
        source = mine if as_list else np.concatenate([b.reshape(-1) for b in mine])
        out = np.zeros(shape, dt.numpy)
        finish(dist.reduce_scatter(out, source, op, async_op=async_op))
        for b, original in zip(mine, blocks[r], strict=False):
            np.testing.assert_array_equal(b, original)  # inputs are not modified
        return out

    results = run_world(size, rank_main)
    for i, out in enumerate(results):
        assert_reduced(out, [blocks[r][i] for r in range(size)], op, what=f"rank {i}")


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
@settings(max_examples=examples(6))
@given(data=st.data(), size=SIZES, shape=SHAPES, async_op=st.booleans())
def test_broadcast(dt, data, size, shape, async_op):
    inputs = data.draw(world_inputs(size, dt, shape))
    root = data.draw(roots(size))

    def rank_main():
        x = inputs[dist.get_rank()].copy()
        finish(dist.broadcast(x, root, async_op=async_op))
        return x

    for out, expected in zip(run_world(size, rank_main), ref_broadcast(inputs, root), strict=False):
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
@settings(max_examples=examples(6))
@given(data=st.data(), size=SIZES, shape=SHAPES, as_list=st.booleans(), async_op=st.booleans())
def test_all_gather(dt, data, size, shape, as_list, async_op):
    inputs = data.draw(world_inputs(size, dt, shape))

    def rank_main():
        x = inputs[dist.get_rank()]
        if as_list:
            out = [np.zeros(shape, dt.numpy) for _ in range(size)]
        else:
            out = np.zeros((size, *shape), dt.numpy)
        finish(dist.all_gather(out, x, async_op=async_op))
        return list(out)

    for outs, expected in zip(run_world(size, rank_main), ref_all_gather(inputs), strict=False):
        for got, want in zip(outs, expected, strict=False):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
@settings(max_examples=examples(6))
@given(data=st.data(), size=SIZES, shape=SHAPES, as_list=st.booleans(), async_op=st.booleans())
def test_gather(dt, data, size, shape, as_list, async_op):
    inputs = data.draw(world_inputs(size, dt, shape))
    root = data.draw(roots(size))

    def rank_main():
        r = dist.get_rank()
        out = None
        if r == root:
            out = [np.zeros(shape, dt.numpy) for _ in range(size)] if as_list else np.zeros((size, *shape), dt.numpy)
        finish(dist.gather(inputs[r], out, root, async_op=async_op))
        return None if out is None else list(out)

    for r, (outs, expected) in enumerate(zip(run_world(size, rank_main), ref_gather(inputs, root), strict=False)):
        if r != root:
            assert outs is None
            continue
        for got, want in zip(outs, expected, strict=False):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
@settings(max_examples=examples(6))
@given(data=st.data(), size=SIZES, shape=SHAPES, as_list=st.booleans(), async_op=st.booleans())
def test_scatter(dt, data, size, shape, as_list, async_op):
    parts = data.draw(world_inputs(size, dt, shape))
    root = data.draw(roots(size))

    def rank_main():
        r = dist.get_rank()
        source = None
        if r == root:
            source = list(parts) if as_list else np.stack(parts) if parts[0].ndim else np.array(parts)
        out = np.zeros(shape, dt.numpy)
        finish(dist.scatter(out, source, root, async_op=async_op))
        return out

    for out, expected in zip(run_world(size, rank_main), ref_scatter(parts, root, size), strict=False):
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
@settings(max_examples=examples(6))
@given(data=st.data(), size=SIZES, async_op=st.booleans())
def test_all_to_all_with_uneven_sizes(dt, data, size, async_op):
    # counts[i][j]: how many elements rank i sends to rank j (any size, zero included).
    counts = data.draw(
        st.lists(st.lists(st.integers(0, 6), min_size=size, max_size=size), min_size=size, max_size=size)
    )
    inputs = [[data.draw(tensors(dt, (counts[i][j],))) for j in range(size)] for i in range(size)]

    def rank_main():
        r = dist.get_rank()
        outs = [np.zeros(counts[i][r], dt.numpy) for i in range(size)]
        finish(dist.all_to_all(outs, inputs[r], async_op=async_op))
        return outs

    for outs, expected in zip(run_world(size, rank_main), ref_all_to_all(inputs), strict=False):
        for got, want in zip(outs, expected, strict=False):
            np.testing.assert_array_equal(got, want)


@settings(max_examples=examples(40))
@given(data=st.data(), size=world_sizes(2, 8))
def test_collectives_on_random_subgroups(data, size):
    members = data.draw(subgroups(size))
    dt = data.draw(st.sampled_from(ALL_DTYPES))
    op = data.draw(st.sampled_from(sorted(dt.ops, key=lambda o: o.value)))
    shape = data.draw(SHAPES)
    inputs = data.draw(world_inputs(size, dt, shape, **bounds(op)))
    kind = data.draw(st.sampled_from(["all_reduce", "broadcast", "reduce", "all_gather"]))
    root = members[data.draw(roots(len(members)))]  # a global rank
    sub_inputs = [inputs[g] for g in members]

    def rank_main():
        me = dist.get_rank()
        group = dist.new_group(members)
        x = inputs[me].copy()
        # Traffic on the world group in between must not mix with the subgroup's.
        world_check = np.array([me], np.int64)
        if me not in members:
            assert not group.is_member
            dist.all_reduce(world_check)
            return None
        out = None
        if kind == "all_reduce":
            dist.all_reduce(x, op, group=group)
        elif kind == "broadcast":
            dist.broadcast(x, root, group=group)
        elif kind == "reduce":
            dist.reduce(x, root, op, group=group)
        else:
            out = np.zeros((len(members), *shape), dt.numpy)
            dist.all_gather(out, x, group=group)
        dist.all_reduce(world_check)
        assert world_check[0] == size * (size - 1) // 2
        return x if out is None else out

    results = run_world(size, rank_main)
    group_root = members.index(root)
    for g, out in zip(members, (results[g] for g in members), strict=False):
        where = f"global rank {g} in group {members}"
        if kind == "all_reduce" or (kind == "reduce" and g == root):
            assert_reduced(out, sub_inputs, op, what=where)
        elif kind == "broadcast":
            np.testing.assert_array_equal(out, ref_broadcast(sub_inputs, group_root)[0], err_msg=where)
        elif kind == "reduce":
            np.testing.assert_array_equal(out, inputs[g], err_msg=where)
        else:
            np.testing.assert_array_equal(out, np.stack(sub_inputs), err_msg=where)
