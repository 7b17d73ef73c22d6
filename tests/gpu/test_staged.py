"""Collectives on CUDA tensors (host-staged, ``ferrodist.gpu``), under the CUDA simulator,
against the same naive numpy references as the CPU property suite.

Example counts (CI profile, derandomized; the simulator runs every GPU thread in Python,
so there are fewer than for the CPU suite in tests/collectives/test_properties.py):
- all_reduce: 2 examples for each (dtype, op) pair (13 dtypes, 83 pairs);
- reduce, reduce_scatter: 1 example for each (dtype, op) pair;
- inputs that are the same on every rank (hypothesis starts from all zeros) are replaced by
  small values that differ per rank and element, so even the first example checks something;
- broadcast, all_gather, gather, scatter, all_to_all: 2 examples per dtype;
- 12 examples with 48-byte segments, so that every staged algorithm runs many segments;
- bf16 compression: 10 examples.
World sizes 1..5, shapes from 0-d to 3-d with up to 40 elements, async_op drawn at random.
Tolerances as in the CPU suite; every rank's all_reduce result must be bit-identical.
"""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferrodist.collectives as dist
import ferrodist.core as fc
from _helpers import examples
from ferrodist.core import ALL_DTYPES, InvalidArgument, ReduceOp
from ferrodist.testing import (
    assert_reduced,
    reduction_tolerance,
    ref_all_gather,
    ref_all_to_all,
    ref_broadcast,
    ref_gather,
    ref_reduce,
    ref_scatter,
    run_world,
)
from ferrodist.testing.strategies import roots, shapes, tensors, world_inputs

gpu = pytest.importorskip("ferrodist.gpu")

PAIRS = [(dt, op) for dt in ALL_DTYPES for op in sorted(dt.ops, key=lambda o: o.value)]
PAIR_IDS = [f"{d.name}-{o.name}" for d, o in PAIRS]
SIZES = st.sampled_from([3, 2, 1, 4, 5])
SHAPES = st.one_of(st.sampled_from([(37,), (4, 5), (3,), (0,), ()]), shapes(max_elements=40))


def dev(array):
    return fc.as_tensor(np.ascontiguousarray(array)).to("cuda")


def host(tensor):
    return tensor.to("cpu").numpy()


def varied(inputs):
    """``inputs``, unless every rank's array is the same (hypothesis's first, simplest
    example is all zeros, under which a lost AVG or a wrong block would pass): then small
    values that differ per rank and per element, within PRODUCT's bounds."""
    if len(inputs) > 1 and any(x.tobytes() != inputs[0].tobytes() for x in inputs):
        return inputs
    out = []
    for r, x in enumerate(inputs):
        i = np.arange(x.size).reshape(x.shape) + 2 * r + 1
        if x.dtype == np.bool_:
            out.append((i % 2).astype(np.bool_))
        elif np.dtype(x.dtype).kind == "u":
            out.append((i % 3).astype(x.dtype))
        else:
            out.append((i % 5 - 2).astype(np.float64).astype(x.dtype))
    return out


def bounds(op):
    return {"low": -2.0, "high": 2.0} if op is ReduceOp.PRODUCT else {}


def finish(work):
    if work is not None:
        work.wait(30)


# Integers wrap on the GPU; the simulator computes with numpy scalars, which warn as they wrap.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.usefixtures("staged_route"),
]


@contextlib.contextmanager
def segments_of(nbytes):
    """Every staged message at most ``nbytes``: many segments even for tiny tensors."""
    engine = gpu.engine()
    saved, engine.segment_bytes = engine.segment_bytes, nbytes
    try:
        yield engine
    finally:
        engine.segment_bytes = saved


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=PAIR_IDS)
@settings(max_examples=examples(2))
@given(data=st.data(), size=SIZES, shape=SHAPES, async_op=st.booleans())
def test_all_reduce(dt, op, data, size, shape, async_op):
    inputs = varied(data.draw(world_inputs(size, dt, shape, **bounds(op))))

    def rank_main():
        x = dev(inputs[dist.get_rank()])
        finish(dist.all_reduce(x, op, async_op=async_op))
        return host(x).reshape(shape)

    results = run_world(size, rank_main)
    for r, out in enumerate(results):
        assert_reduced(out, inputs, op, what=f"rank {r}")
        assert out.tobytes() == results[0].tobytes(), f"rank {r} disagrees with rank 0 bit for bit"


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=PAIR_IDS)
@settings(max_examples=examples(1))
@given(data=st.data(), size=SIZES, shape=SHAPES, async_op=st.booleans())
def test_reduce(dt, op, data, size, shape, async_op):
    inputs = varied(data.draw(world_inputs(size, dt, shape, **bounds(op))))
    root = data.draw(roots(size))

    def rank_main():
        x = dev(inputs[dist.get_rank()])
        finish(dist.reduce(x, root, op, async_op=async_op))
        return host(x).reshape(shape)

    expected = ref_reduce(inputs, root, op)
    for r, out in enumerate(run_world(size, rank_main)):
        if r == root:
            assert_reduced(out, inputs, op, what=f"root {r}")
        else:
            np.testing.assert_array_equal(out, expected[r], err_msg=f"rank {r} must keep its input")


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=PAIR_IDS)
@settings(max_examples=examples(1))
@given(data=st.data(), size=SIZES, shape=SHAPES, as_list=st.booleans())
def test_reduce_scatter(dt, op, data, size, shape, as_list):
    blocks = [varied(data.draw(world_inputs(size, dt, shape, **bounds(op)))) for _ in range(size)]

    def rank_main():
        r = dist.get_rank()
        mine = [dev(b) for b in blocks[r]]
        source = mine if as_list else dev(np.concatenate([b.reshape(-1) for b in blocks[r]]))
        out = dev(np.zeros(shape, dt.numpy))
        dist.reduce_scatter(out, source, op)
        if as_list:
            for b, original in zip(mine, blocks[r], strict=True):
                np.testing.assert_array_equal(host(b).reshape(original.shape), original)
        return host(out).reshape(shape)

    for i, out in enumerate(run_world(size, rank_main)):
        assert_reduced(out, [blocks[r][i] for r in range(size)], op, what=f"rank {i}")


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
@settings(max_examples=examples(2))
@given(data=st.data(), size=SIZES, shape=SHAPES, async_op=st.booleans())
def test_broadcast(dt, data, size, shape, async_op):
    inputs = varied(data.draw(world_inputs(size, dt, shape)))
    root = data.draw(roots(size))

    def rank_main():
        x = dev(inputs[dist.get_rank()])
        finish(dist.broadcast(x, root, async_op=async_op))
        return host(x).reshape(shape)

    for out, expected in zip(run_world(size, rank_main), ref_broadcast(inputs, root), strict=True):
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
@settings(max_examples=examples(2))
@given(data=st.data(), size=SIZES, shape=SHAPES, as_list=st.booleans())
def test_all_gather(dt, data, size, shape, as_list):
    inputs = varied(data.draw(world_inputs(size, dt, shape)))

    def rank_main():
        x = dev(inputs[dist.get_rank()])
        if as_list:
            out = [dev(np.zeros(shape, dt.numpy)) for _ in range(size)]
            dist.all_gather(out, x)
            return [host(o).reshape(shape) for o in out]
        out = dev(np.zeros((size, *shape), dt.numpy))
        dist.all_gather(out, x)
        return list(host(out).reshape((size, *shape)))

    for outs, expected in zip(run_world(size, rank_main), ref_all_gather(inputs), strict=True):
        for got, want in zip(outs, expected, strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
@settings(max_examples=examples(2))
@given(data=st.data(), size=SIZES, shape=SHAPES)
def test_gather_and_scatter(dt, data, size, shape):
    inputs = varied(data.draw(world_inputs(size, dt, shape)))
    root = data.draw(roots(size))

    def rank_main():
        r = dist.get_rank()
        gathered = dev(np.zeros((size, *shape), dt.numpy)) if r == root else None
        dist.gather(dev(inputs[r]), gathered, root)
        parts = [dev(p) for p in inputs] if r == root else None
        mine = dev(np.zeros(shape, dt.numpy))
        dist.scatter(mine, parts, root)
        return (None if gathered is None else host(gathered).reshape((size, *shape))), host(mine).reshape(shape)

    results = run_world(size, rank_main)
    for r, ((gathered, mine), want) in enumerate(zip(results, ref_gather(inputs, root), strict=True)):
        if r == root:
            for got, expected in zip(gathered, want, strict=True):
                np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(mine, ref_scatter(inputs, root, size)[r])


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
@settings(max_examples=examples(2))
@given(data=st.data(), size=SIZES)
def test_all_to_all_with_uneven_sizes(dt, data, size):
    counts = data.draw(
        st.lists(st.lists(st.integers(0, 6), min_size=size, max_size=size), min_size=size, max_size=size)
    )
    inputs = [[data.draw(tensors(dt, (counts[i][j],))) for j in range(size)] for i in range(size)]

    def rank_main():
        r = dist.get_rank()
        outs = [dev(np.zeros(counts[i][r], dt.numpy)) for i in range(size)]
        dist.all_to_all(outs, [dev(x) for x in inputs[r]])
        return [host(o) for o in outs]

    for outs, expected in zip(run_world(size, rank_main), ref_all_to_all(inputs), strict=True):
        for got, want in zip(outs, expected, strict=True):
            np.testing.assert_array_equal(got, want)


@settings(max_examples=examples(12))
@given(data=st.data(), size=st.sampled_from([3, 2, 4]), n=st.integers(0, 60))
def test_many_segments(data, size, n):
    """48-byte segments: all_reduce, reduce, broadcast, all_gather and reduce_scatter each
    move many windows; the results must not change."""
    dt = data.draw(st.sampled_from([fc.float64, fc.int32, fc.bfloat16, fc.uint8]))
    op = data.draw(st.sampled_from([o for o in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG) if o in dt.ops]))
    inputs = varied(data.draw(world_inputs(size, dt, (n,))))
    rows = varied(data.draw(world_inputs(size, dt, (size * n,))))
    root = data.draw(roots(size))

    def rank_main():
        r = dist.get_rank()
        a, b, c = dev(inputs[r]), dev(inputs[r]), dev(inputs[r])
        dist.all_reduce(a, op)
        dist.reduce(b, root, op)
        dist.broadcast(c, root)
        gathered = dev(np.zeros(size * n, dt.numpy))
        dist.all_gather(gathered, dev(inputs[r]))
        scattered = dev(np.zeros(n, dt.numpy))
        dist.reduce_scatter(scattered, dev(rows[r]), op)
        return host(a), host(b), host(c), host(gathered), host(scattered)

    with segments_of(48):
        results = run_world(size, rank_main)
    for r, (a, b, c, gathered, scattered) in enumerate(results):
        assert_reduced(a, inputs, op, what=f"all_reduce on rank {r}")
        if r == root:
            assert_reduced(b, inputs, op, what=f"reduce on rank {r}")
        np.testing.assert_array_equal(c, inputs[root])
        np.testing.assert_array_equal(gathered, np.concatenate(inputs))
        assert_reduced(scattered, [x[r * n : (r + 1) * n] for x in rows], op, what=f"reduce_scatter on rank {r}")


@settings(max_examples=examples(10))
@given(data=st.data(), size=st.sampled_from([2, 3, 4]), n=st.integers(1, 40))
def test_bf16_compression(data, size, n):
    """compress='bf16': the result is the bfloat16 reduction of the bfloat16-rounded
    inputs, widened back to float32, on every rank alike."""
    op = data.draw(st.sampled_from([ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX]))
    inputs = varied(data.draw(world_inputs(size, fc.float32, (n,))))

    def rank_main():
        x = dev(inputs[dist.get_rank()])
        dist.all_reduce(x, op, compress="bf16")
        return host(x)

    rounded = [x.astype(ml_dtypes.bfloat16) for x in inputs]
    results = run_world(size, rank_main)
    for r, out in enumerate(results):
        assert out.dtype == np.float32
        assert_reduced(out.astype(ml_dtypes.bfloat16), rounded, op, what=f"rank {r}")
        assert out.tobytes() == results[0].tobytes()
    tolerance = reduction_tolerance([x.astype(np.float64) for x in inputs], op) + 2 * 2.0**-8 * np.max(
        np.abs(np.stack(inputs)), axis=0
    ) * (size if op is not ReduceOp.AVG else 1)
    exact = {ReduceOp.SUM: np.sum, ReduceOp.AVG: np.mean, ReduceOp.MAX: np.max}[op](np.stack(inputs), axis=0)
    assert np.all(np.abs(results[0].astype(np.float64) - exact) <= tolerance + 1e-30)


def test_staging_copies_the_tensor_once_each_way_through_bounded_buffers():
    """A 4-rank all_reduce of 4000 float32 with 1 KiB segments: each rank copies its
    tensor once to the host and once back (16 parts of 256 elements), and no host buffer
    exceeds a segment."""
    n, size = 4000, 4
    with segments_of(1024) as engine:
        engine.stats.largest_host_buffer = 0  # run_world's rank threads start with empty pools

        def rank_main():
            x = dev(np.ones(n, np.float32))
            dist.all_reduce(x)
            return host(x)

        before = engine.stats.snapshot()  # the ranks are threads of this process: one engine
        results = run_world(size, rank_main)
        after = engine.stats.snapshot()
        largest = engine.stats.largest_host_buffer
    for x in results:
        np.testing.assert_array_equal(x, np.full(n, 4.0, np.float32))
    expected = size * n * 4  # all ranks together
    assert after[0] - before[0] == expected and after[1] - before[1] == expected, (before, after, expected)
    assert 0 < largest <= 1024, largest


def test_point_to_point_on_device():
    def rank_main():
        r = dist.get_rank()
        x = dev(np.arange(6, dtype=np.int16) * (r + 1))
        if r == 0:
            dist.send(x, 1, tag=3)
            work = dist.irecv(x, 1, tag=4)
            work.wait(10)
        else:
            got = dev(np.zeros(6, np.int16))
            dist.recv(got, 0, tag=3)
            dist.isend(got, 0, tag=4).wait(10)
            x = got
        return host(x)

    a, b = run_world(2, rank_main)
    np.testing.assert_array_equal(a, np.arange(6, dtype=np.int16))
    np.testing.assert_array_equal(b, np.arange(6, dtype=np.int16))


def test_a_device_tensor_receives_from_any_rank():
    def rank_main():
        r = dist.get_rank()
        if r:
            dist.send(dev(np.full(3, r, np.float32)), 0, tag=2)
            return None
        got = []
        for _ in range(2):
            x = dev(np.zeros(3, np.float32))
            work = dist.irecv(x, tag=2)
            work.wait(10)
            got.append((work.source, host(x).tolist()))
        return sorted(got)

    assert run_world(3, rank_main)[0] == [(1, [1.0] * 3), (2, [2.0] * 3)]


def test_errors_name_the_rank_and_what_to_do():
    def rank_main():
        on_gpu, on_cpu = dev(np.zeros(4, np.float32)), np.zeros(8, np.float32)
        with pytest.raises(InvalidArgument, match="different devices"):
            dist.all_gather(on_cpu, on_gpu)
        with pytest.raises(InvalidArgument, match="needs a float32 tensor"):
            dist.all_reduce(np.zeros(2, np.float64), compress="bf16")
        with pytest.raises(InvalidArgument, match="needs a float32 tensor"):
            dist.all_reduce(dev(np.zeros(2, np.float64)), compress="bf16")
        with pytest.raises(InvalidArgument, match="unknown"):
            dist.all_reduce(dev(np.zeros(2, np.float32)), compress="fp8")
        with pytest.raises(InvalidArgument, match=r"rank \d: all_reduce: ReduceOp.BXOR does not apply to float32"):
            dist.all_reduce(dev(np.zeros(2, np.float32)), ReduceOp.BXOR)
        return True

    assert run_world(2, rank_main) == [True, True]


def test_device_view_finds_cuda_tensors_and_device_arrays_cheaply(cuda):
    array = cuda.to_device(np.arange(6, dtype=np.float32))
    t = fc.device_view(array)
    assert t is not None and t.is_cuda and t.shape == (6,) and t.dtype is fc.float32
    assert t.data_ptr() == fc.as_tensor(array).data_ptr()  # the same memory
    assert fc.device_view(t) is t
    assert fc.device_view(array[::2]) is None  # not contiguous: as_tensor says why
    assert fc.device_view(np.ones(3)) is None and fc.device_view(fc.as_tensor(np.ones(3))) is None


def test_a_device_call_seen_before_skips_the_checks(cuda, checks_made):
    """A repeated all_reduce of the same kind of device array or CUDA Tensor finds its plan
    from the argument as given: one check per rank and kind of call."""
    made = checks_made

    def rank_main():
        r = dist.get_rank()
        x = cuda.to_device(np.full(5, r + 1, np.float32))
        t = dev(np.full(3, r + 1.0))
        for _ in range(3):
            dist.all_reduce(x)
            dist.all_reduce(t, "max")
        return x.copy_to_host(), host(t)

    for x, t in run_world(2, rank_main):
        np.testing.assert_array_equal(x, np.full(5, 3 * 2**2, np.float32))
        np.testing.assert_array_equal(t, np.full(3, 2.0))
    assert sorted(made) == ["all_reduce"] * 4
