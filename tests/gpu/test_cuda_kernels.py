"""The CUDA kernels of ferrodist.gpu against numpy and the CPU kernels of ferrodist.core.

They run on Numba's CUDA simulator (tests/gpu/conftest.py), which runs every CUDA thread
as a Python thread: arrays stay small (at most 80 elements) and grids too (32 or 64
threads per block, 1 to 3 blocks, so the grid-stride loops take several turns), except
the exhaustive widening of all 65536 16-bit patterns (one launch of 64 blocks of 32
threads, about 3 s per type). float16/bfloat16 results must equal numpy's float32
arithmetic rounded once (ml_dtypes for bfloat16), and the CPU kernels bit for bit
wherever the result is not NaN (NaN payloads of arithmetic results are the hardware's
choice; NaN must stay NaN).

Example counts (CI profile): reduce_into 4 per (dtype, op) pair (83 pairs); scale 6 per
(dtype, multiply/divide); AVG as reduce-then-scale 6 per dtype; float32 -> half narrowing
30 per half type (64 random float32 bit patterns each, with their ties); the wide
(16-byte) kernels against the CPU kernels at offsets within a vector, 12 per wide dtype for
reductions, 6 for scaling and 12 per half type for casts; pack/unpack roundtrip 30;
launch_config 300.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import examples
from ferrodist.core import ALL_DTYPES, DType, InvalidArgument, ReduceOp, Tensor, _kernels, as_tensor, dtype, reducer

pytest.importorskip("ferrodist.gpu", reason="ferrodist-gpu is not installed (pip install packages/gpu)")
from ferrodist.gpu import _cuda_buckets as buckets
from ferrodist.gpu import _cuda_kernels as kernels
from ferrodist.testing.strategies import shapes

# Integer kernels wrap around; the simulator computes with numpy scalars, which warn about it.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

HALVES = ("float16", "bfloat16")
FLOATS = [dtype(name) for name in ("float16", "bfloat16", "float32", "float64")]
PAIRS = [(dt, op) for dt in ALL_DTYPES for op in sorted(dt.ops, key=lambda o: o.value)]
# Small grids: a block of 32 or 64 threads, 1 to 3 blocks (the loops stride past n > 32).
GRIDS = st.sampled_from(
    [{"threads": 32, "max_blocks": 1}, {"threads": 32, "max_blocks": 3}, {"threads": 64, "max_blocks": 2}]
)

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # the kernel adds; scale divides at the end
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
_BOOL_UFUNCS = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.MIN: np.logical_and,
}


def host_values(dt: DType, n: int) -> st.SearchStrategy[np.ndarray]:
    """n values of ``dt``: integers over their whole range; floats of any kind (NaN, inf,
    subnormals, -0); float16/bfloat16 as random bit patterns."""
    if dt.name in HALVES:
        return st.lists(st.integers(0, 0xFFFF), min_size=n, max_size=n).map(
            lambda v: np.array(v, np.uint16).view(dt.numpy)
        )
    if dt.kind == "bool":
        elements: st.SearchStrategy = st.booleans()
    elif dt.is_floating:
        elements = st.floats(width=32 if dt.name == "float32" else 64)
    else:
        info = np.iinfo(dt.numpy)
        elements = st.integers(int(info.min), int(info.max))
    return st.lists(elements, min_size=n, max_size=n).map(lambda v: np.array(v, dt.numpy))


def to_device(cuda, values: np.ndarray):
    """A device copy as the kernels store it: float16/bfloat16 as uint16 bits."""
    if values.dtype.itemsize == 2 and values.dtype.kind not in "iu":
        values = values.view(np.uint16)
    return cuda.to_device(np.ascontiguousarray(values))


def to_host(array, dt: DType) -> np.ndarray:
    host = array.copy_to_host()
    return host.view(dt.numpy) if dt.name in HALVES else host


def reference(a: np.ndarray, b: np.ndarray, dt: DType, op: ReduceOp) -> np.ndarray:
    """The naive result: numpy, float16/bfloat16 combined in float32 and rounded once."""
    with np.errstate(all="ignore"):
        if dt.name in HALVES:
            return _UFUNCS[op](a.astype(np.float32), b.astype(np.float32)).astype(dt.numpy)
        if dt.kind == "bool":
            return _BOOL_UFUNCS.get(op, _UFUNCS[op])(a, b)
        return _UFUNCS[op](a, b)


def assert_same(got: np.ndarray, expected: np.ndarray, dt: DType) -> None:
    """Equal values (NaN where NaN is expected; 0 == -0), in the same dtype."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if not dt.is_floating:
        np.testing.assert_array_equal(got, expected)
        return
    nan = np.isnan(expected.astype(np.float64))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), nan)
    np.testing.assert_array_equal(got[~nan].astype(np.float64), expected[~nan].astype(np.float64))


def assert_same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    """Identical bytes wherever ``expected`` is not NaN, NaN where it is."""
    width = np.dtype(f"u{got.dtype.itemsize}")
    if got.dtype.kind == "V" or got.dtype.kind == "f" or got.dtype == ml_dtypes.bfloat16:
        nan = np.isnan(expected.astype(np.float64))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), nan)
    else:
        nan = np.zeros(expected.shape, bool)
    np.testing.assert_array_equal(got.view(width)[~nan], expected.view(width)[~nan])


# --- reduce_into -------------------------------------------------------------------------


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=[f"{d.name}-{o.name}" for d, o in PAIRS])
@settings(max_examples=examples(4))
@given(data=st.data(), n=st.integers(0, 80), grid=GRIDS)
def test_reduce_into_matches_numpy_and_the_cpu_kernels(cuda, dt, op, data, n, grid):
    a, b = data.draw(host_values(dt, n)), data.draw(host_values(dt, n))
    dst, src = to_device(cuda, a), to_device(cuda, b)
    kernels.reduce_into(dst, src, dt, op, **grid)
    got = to_host(dst, dt)
    assert_same(got, reference(a, b, dt, op), dt)
    on_cpu = a.copy()
    reducer(dt, ReduceOp.SUM if op is ReduceOp.AVG else op)(on_cpu, [a, b], 1.0)
    assert_same_bits(got, on_cpu)
    assert_same_bits(to_host(src, dt), b)  # the source is only read


def test_reduce_into_takes_any_contiguous_shapes_of_the_same_size(cuda):
    dst = cuda.to_device(np.arange(6, dtype=np.int32).reshape(2, 3))
    kernels.reduce_into(dst, cuda.to_device(np.full(6, 10, np.int32)), "int32", "sum")
    np.testing.assert_array_equal(dst.copy_to_host(), np.arange(10, 16, dtype=np.int32).reshape(2, 3))
    # A float16 array may also be passed as float16 (rather than its uint16 bits).
    half = cuda.to_device(np.float16([1.5, -2.0]))
    kernels.reduce_into(half, cuda.to_device(np.float16([0.25, 8.0])), "float16", "max")
    np.testing.assert_array_equal(half.copy_to_host(), np.float16([1.5, 8.0]))


# --- scale and AVG -------------------------------------------------------------------------


def scaled(x: np.ndarray, dt: DType, factor: float, divide: bool) -> np.ndarray:
    with np.errstate(all="ignore"):
        if dt.name == "float64":
            return x / factor if divide else x * factor
        f, wide = np.float32(factor), x.astype(np.float32)
        return (wide / f if divide else wide * f).astype(dt.numpy)


@pytest.mark.parametrize("divide", [False, True], ids=["multiply", "divide"])
@pytest.mark.parametrize("dt", FLOATS, ids=[d.name for d in FLOATS])
@settings(max_examples=examples(6))
@given(
    data=st.data(),
    n=st.integers(0, 80),
    factor=st.one_of(st.integers(1, 64).map(float), st.floats(-1e4, 1e4, allow_nan=False).filter(bool)),
    grid=GRIDS,
)
def test_scale_rounds_once_in_float32_or_float64(cuda, dt, divide, data, n, factor, grid):
    x = data.draw(host_values(dt, n))
    d = to_device(cuda, x)
    kernels.scale(d, dt, factor, divide=divide, **grid)
    assert_same(to_host(d, dt), scaled(x, dt, factor, divide), dt)


@pytest.mark.parametrize("dt", FLOATS, ids=[d.name for d in FLOATS])
@settings(max_examples=examples(6))
@given(data=st.data(), world=st.integers(1, 4), n=st.integers(0, 40))
def test_avg_is_a_sum_of_received_chunks_then_one_division(cuda, dt, data, world, n):
    chunks = [data.draw(host_values(dt, n)) for _ in range(world)]
    acc_device = to_device(cuda, chunks[0])
    expected = chunks[0]
    for chunk in chunks[1:]:
        kernels.reduce_into(acc_device, to_device(cuda, chunk), dt, ReduceOp.AVG, threads=32, max_blocks=2)
        expected = reference(expected, chunk, dt, ReduceOp.SUM)
    kernels.scale(acc_device, dt, world, divide=True, threads=32, max_blocks=2)
    assert_same(to_host(acc_device, dt), scaled(expected, dt, world, True), dt)


# --- wide loads ----------------------------------------------------------------------------

WIDE = [dtype(name) for name in ("float16", "bfloat16", "float32")]


def _per_vector(values: np.ndarray) -> int:
    return 16 // values.dtype.itemsize


def _at(cuda, values: np.ndarray, offset: int):
    """A device view of ``values`` starting ``offset`` elements into a larger array, so its
    address is 16-byte aligned only for some offsets. The array underneath has at least one
    element: on a GPU an empty allocation has a null pointer, and Numba refuses to slice one
    (``non-empty slice into empty slice``)."""
    bits = values.view(np.uint16) if values.dtype.itemsize == 2 else values
    padded = np.zeros(offset + max(bits.size, 1), bits.dtype)
    padded[offset : offset + bits.size] = bits
    return cuda.to_device(padded)[offset : offset + bits.size]


def _offsets(per: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(0), st.integers(0, per - 1))  # aligned about half the time


@pytest.mark.parametrize("dt", WIDE, ids=lambda d: d.name)
@settings(max_examples=examples(12))
@given(
    data=st.data(),
    n=st.integers(0, 40),
    op=st.sampled_from([ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]),
    grid=GRIDS,
)
def test_wide_and_narrow_reductions_give_the_same_bits(cuda, dt, data, n, op, grid):
    """Four float32 or eight halves per 16-byte load and store where both arrays are
    aligned, element by element elsewhere, the last 1 to 7 elements by the first threads:
    the CPU kernels' bits either way (views at offsets within a vector take both paths)."""
    a, b = data.draw(host_values(dt, n)), data.draw(host_values(dt, n))
    per = _per_vector(a)
    dst, src = _at(cuda, a, data.draw(_offsets(per))), _at(cuda, b, data.draw(_offsets(per)))
    kernels.reduce_into(dst, src, dt, op, **grid)
    on_cpu = a.copy()
    reducer(dt, op)(on_cpu, [a, b], 1.0)
    assert_same_bits(to_host(dst, dt), on_cpu)


def _half_nans(name: str) -> np.ndarray:
    """NaNs of both signs with payloads, infinities, zeros, a subnormal and ordinary values."""
    if name == "float16":
        bits = [0x7E00, 0xFE00, 0x7C01, 0xFD55, 0x7FFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x3C00, 0xC000]
    else:
        bits = [0x7FC0, 0xFFC0, 0x7F81, 0xFFA5, 0x7FFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x3F80, 0xC000]
    return np.array(bits, np.uint16)


@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("offset", [0, 1], ids=["wide", "narrow"])
def test_min_and_max_pass_nan_through_with_the_cpu_kernels_bits(cuda, name, op, offset):
    """MIN and MAX select an operand, so a NaN result is an input NaN rounded back: the
    CPU kernels' exact bits, NaN sign included (float16: 0x7E00 with the sign; bfloat16:
    the input with its quiet bit set). Every pair of the special values, both paths."""
    dt = dtype(name)
    special = _half_nans(name)
    a, b = np.repeat(special, special.size), np.tile(special, special.size)
    dst = _at(cuda, a.view(dt.numpy), offset)
    kernels.reduce_into(dst, _at(cuda, b.view(dt.numpy), offset), dt, op, threads=64, max_blocks=2)
    on_cpu = a.view(dt.numpy).copy()
    reducer(dt, op)(on_cpu, [a.view(dt.numpy), b.view(dt.numpy)], 1.0)
    np.testing.assert_array_equal(dst.copy_to_host(), on_cpu.view(np.uint16))


@pytest.mark.parametrize("dt", WIDE, ids=lambda d: d.name)
@settings(max_examples=examples(6))
@given(data=st.data(), n=st.integers(0, 40), divide=st.booleans(), grid=GRIDS)
def test_wide_and_narrow_scaling_give_the_same_bits(cuda, dt, data, n, divide, grid):
    x = data.draw(host_values(dt, n))
    d = _at(cuda, x, data.draw(_offsets(_per_vector(x))))
    kernels.scale(d, dt, 3.0, divide=divide, **grid)
    assert_same(to_host(d, dt), scaled(x, dt, 3.0, divide), dt)


@pytest.mark.parametrize("name", HALVES)
@settings(max_examples=examples(12))
@given(patterns=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40), data=st.data(), grid=GRIDS)
def test_wide_and_narrow_casts_give_the_same_bits(cuda, name, patterns, data, grid):
    dt = dtype(name)
    values = np.array(patterns, np.uint32).view(np.float32)
    narrow = _at(cuda, np.zeros(values.size, np.uint16), data.draw(_offsets(8)))
    kernels.cast(narrow, dt, _at(cuda, values, data.draw(_offsets(4))), "float32", **grid)
    expected = np.empty(values.size, np.uint16)
    (_kernels.f32_to_f16 if name == "float16" else _kernels.f32_to_bf16)(expected, values)
    np.testing.assert_array_equal(narrow.copy_to_host(), expected)
    wide = _at(cuda, np.zeros(values.size, np.float32), data.draw(_offsets(4)))
    kernels.cast(wide, "float32", narrow, dt, **grid)
    back = np.empty(values.size, np.float32)
    (_kernels.f16_to_f32 if name == "float16" else _kernels.bf16_to_f32)(back, expected)
    np.testing.assert_array_equal(wide.copy_to_host().view(np.uint32), back.view(np.uint32))


def test_aligned_arrays_take_the_wide_kernels(cuda, monkeypatch):
    """Arrays that start on a 16-byte boundary go through the wide kernels, however short
    (the first threads then do every element); a view off the boundary and a dtype without
    a wide kernel do not."""
    launched = []
    real = kernels._launch

    def spy(kernel, n, *args):
        launched.append(kernel.py_func.__name__ if hasattr(kernel, "py_func") else kernel.__name__)
        return real(kernel, n, *args)

    monkeypatch.setattr(kernels, "_launch", spy)
    halves = cuda.to_device(np.zeros(9, np.uint16))
    kernels.reduce_into(halves, cuda.to_device(np.zeros(9, np.uint16)), "bfloat16", "sum")
    kernels.reduce_into(halves[1:], cuda.to_device(np.zeros(8, np.uint16)), "bfloat16", "sum")
    kernels.reduce_into(halves[:3], cuda.to_device(np.zeros(3, np.uint16)), "float16", "max")
    floats = cuda.to_device(np.zeros(5, np.float32))
    kernels.reduce_into(floats, cuda.to_device(np.ones(5, np.float32)), "float32", "sum")
    kernels.reduce_into(cuda.to_device(np.zeros(4, np.int32)), cuda.to_device(np.ones(4, np.int32)), "int32", "sum")
    kernels.cast(halves[:8], "bfloat16", cuda.to_device(np.ones(8, np.float32)), "float32")
    kernels.cast(cuda.to_device(np.ones(8, np.float32)), "float32", halves[:8], "bfloat16")
    kernels.scale(floats, "float32", 2.0)
    kernels.scale(halves[1:], "bfloat16", 2.0)
    kernels.scale(cuda.to_device(np.ones(3)), "float64", 2.0)
    assert launched == [
        "reduce_half_x8",
        "reduce_half",
        "reduce_half_x8",
        "reduce_f32x4",
        "reduce_plain",
        "narrow_x8",
        "widen_x8",
        "scale_f32x4",
        "scale_half",
        "scale_f64",
    ]
    np.testing.assert_array_equal(floats.copy_to_host(), np.full(5, 2, np.float32))


# --- CUDA tensors: a Tensor, torch's bfloat16 as int16, __cuda_array_interface__ ------------


class CudaArrayInterface:
    """A foreign CUDA array: an object with only ``__cuda_array_interface__``, over device
    memory that it owns (under the simulator, host memory)."""

    def __init__(self, cuda, host: np.ndarray) -> None:
        self.memory = cuda.to_device(host)
        interface = getattr(self.memory, "__cuda_array_interface__", None)
        if interface is None:  # the simulator's device array wraps a host array and exports nothing
            ary = self.memory._ary
            interface = {"shape": ary.shape, "typestr": ary.dtype.str, "data": (ary.ctypes.data, False), "version": 3}
        self.__cuda_array_interface__ = dict(interface, strides=None)

    def values(self) -> np.ndarray:
        return self.memory.copy_to_host()


def test_bfloat16_tensors_over_int16_bits_reduce_without_a_dtype(cuda):
    """torch hands bfloat16 CUDA tensors over as int16 arrays; a Tensor says they hold
    bfloat16, so the dtype may be left out, and the result is the CPU kernels' bits."""
    rng = np.random.default_rng(7)
    a, b = (rng.standard_normal(21).astype(ml_dtypes.bfloat16) for _ in range(2))
    dst = Tensor.from_device_array(cuda.to_device(a.view(np.int16)), dtype="bfloat16")
    src = Tensor.from_device_array(cuda.to_device(b.view(np.int16)), dtype="bfloat16")
    kernels.reduce_into(dst, src)
    on_cpu = a.copy()
    reducer(dtype("bfloat16"), ReduceOp.SUM)(on_cpu, [a, b], 1.0)
    np.testing.assert_array_equal(dst.device_array().copy_to_host(), on_cpu.view(np.int16))
    kernels.reduce_into(dst, src, "bfloat16", "max")  # an explicit dtype that agrees is fine
    kernels.scale(dst, factor=2.0)
    widened = cuda.device_array(21, np.float32)
    kernels.cast(widened, src=dst)
    expected = np.maximum(on_cpu.astype(np.float32), b.astype(np.float32)).astype(ml_dtypes.bfloat16)
    expected = (expected.astype(np.float32) * np.float32(2)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(widened.copy_to_host(), expected.astype(np.float32))


def test_foreign_cuda_arrays_are_reduced_in_place_without_a_copy(cuda):
    a = np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.int16)
    b = np.full(12, 0x3F80, np.int16)  # bfloat16 1.0
    expected = (np.arange(12, dtype=np.float32) + 1).astype(ml_dtypes.bfloat16).view(np.int16)
    dst = CudaArrayInterface(cuda, a)
    kernels.reduce_into(dst, CudaArrayInterface(cuda, b), "bfloat16")
    np.testing.assert_array_equal(dst.values(), expected)  # the caller's memory, not a copy
    f32 = CudaArrayInterface(cuda, np.ones(6, np.float32))
    kernels.scale(f32, factor=4.0)  # float32: the dtype comes from the array
    np.testing.assert_array_equal(f32.values(), np.full(6, 4, np.float32))


def test_tensors_that_say_another_dtype_are_refused(cuda):
    bits = Tensor.from_device_array(cuda.to_device(np.zeros(4, np.int16)), dtype="bfloat16")
    with pytest.raises(InvalidArgument, match="destination has dtype bfloat16 but float16 data must be stored as"):
        kernels.reduce_into(bits, bits, "float16")
    with pytest.raises(InvalidArgument, match="source has dtype bfloat16 but float32 data"):
        kernels.reduce_into(cuda.to_device(np.zeros(4, np.float32)), bits)
    with pytest.raises(InvalidArgument, match="the destination is a Tensor, not a Numba device array or a CUDA"):
        kernels.reduce_into(as_tensor(np.zeros(4, np.float32)), bits)
    with pytest.raises(InvalidArgument, match="gpu scale: no factor"):
        kernels.scale(bits)
    with pytest.raises(InvalidArgument, match="gpu cast: no source"):
        kernels.cast(bits, "bfloat16")


# --- casts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HALVES)
def test_widening_is_exact_for_all_65536_patterns(cuda, name):
    """Every 16-bit pattern widened in one launch; then narrowed back: the same pattern
    returns, except that NaNs stay NaNs of the same sign (checked on every 7th pattern
    and all NaN/inf/subnormal/zero patterns, to keep the simulator under a few seconds)."""
    dt = dtype(name)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = cuda.device_array(every.size, np.float32)
    kernels.cast(wide, "float32", cuda.to_device(every), dt, threads=32, max_blocks=64)
    got = wide.copy_to_host()
    expected = every.view(dt.numpy).astype(np.float32)
    assert_same_bits(got, expected)
    on_cpu = np.empty_like(got)
    (_kernels.f16_to_f32 if name == "float16" else _kernels.bf16_to_f32)(on_cpu, every)
    np.testing.assert_array_equal(got.view(np.uint32), on_cpu.view(np.uint32))  # NaN payloads too

    exponent_mask = 0x7C00 if name == "float16" else 0x7F80
    exponent = every & exponent_mask
    subset = every[(np.arange(every.size) % 7 == 0) | (exponent == 0) | (exponent == exponent_mask)]
    back = cuda.device_array(subset.size, np.uint16)
    kernels.cast(
        back, dt, cuda.to_device(subset.view(dt.numpy).astype(np.float32)), "float32", threads=32, max_blocks=32
    )
    assert_same_bits(back.copy_to_host().view(dt.numpy), subset.view(dt.numpy))
    nan = np.isnan(subset.view(dt.numpy).astype(np.float32))
    np.testing.assert_array_equal(back.copy_to_host()[nan] & 0x8000, subset[nan] & 0x8000)


def _ties(bits: np.ndarray, name: str) -> np.ndarray:
    """float32 patterns exactly halfway between two neighbours of the narrow type."""
    shift = np.uint32(13 if name == "float16" else 16)
    return (bits & ~((np.uint32(1) << shift) - np.uint32(1))) | (np.uint32(1) << (shift - np.uint32(1)))


SPECIAL_F32 = {
    "zeros and infinities": [0x00000000, 0x80000000, 0x7F800000, 0xFF800000],
    "quiet, signalling and payload NaNs": [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00001, 0x7FFFFFFF],
    "float32 subnormals": [0x00000001, 0x807FFFFF, 0x00400000],
    "float16 and bfloat16 overflow edges": [0x477FE000, 0x477FEFFF, 0x477FF000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF],
    "float16 subnormal edges": [0x33800000, 0x33000000, 0x33400000, 0x33C00000, 0x38800000, 0x387FE000],
    "bfloat16 subnormals and ties": [0x00800000, 0x00018000, 0x3F808000, 0x3F818000, 0x3F801000, 0x3F803000],
}
SPECIAL_BITS = np.array([bits for group in SPECIAL_F32.values() for bits in group], np.uint32)


@pytest.mark.parametrize("name", HALVES)
@settings(max_examples=examples(30))
@given(patterns=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64), grid=GRIDS)
def test_narrowing_rounds_to_nearest_even_and_keeps_nan(cuda, name, patterns, grid):
    dt = dtype(name)
    bits = np.array(patterns, np.uint32)
    values = np.concatenate([bits, _ties(bits, name), SPECIAL_BITS]).view(np.float32)
    narrow = cuda.device_array(values.size, np.uint16)
    kernels.cast(narrow, dt, cuda.to_device(values), "float32", **grid)
    got = narrow.copy_to_host()
    with np.errstate(all="ignore"):
        expected = values.astype(dt.numpy)  # numpy / ml_dtypes: nearest-even
    assert_same_bits(got.view(dt.numpy), expected)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[nan] >> 15, values[nan].view(np.uint32) >> 31)  # the sign survives
    on_cpu = np.empty_like(got)
    (_kernels.f32_to_f16 if name == "float16" else _kernels.f32_to_bf16)(on_cpu, values)
    np.testing.assert_array_equal(got, on_cpu)  # the CPU kernels' bits, NaNs included


# --- pack / unpack -------------------------------------------------------------------------


@settings(max_examples=examples(30))
@given(
    data=st.data(),
    sizes=st.lists(shapes(max_elements=20, max_dims=2), min_size=0, max_size=9),
    numpy_type=st.sampled_from([np.float32, np.int64, np.uint8, np.float64, np.uint16]),
    custom=st.booleans(),
    grid=GRIDS,
)
def test_pack_then_unpack_returns_every_array(cuda, data, sizes, numpy_type, custom, grid):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    arrays = [np.asarray(rng.integers(1, 100, size=shape)).astype(numpy_type) for shape in sizes]
    if custom:  # any order, with gaps
        order = data.draw(st.permutations(range(len(arrays))))
        offsets, end = [0] * len(arrays), 0
        for j in order:
            end += data.draw(st.integers(0, 3))
            offsets[j], end = end, end + arrays[j].size
    else:
        offsets, end = None, sum(a.size for a in arrays)
    capacity = end + data.draw(st.integers(0, 3))
    starts = offsets if offsets is not None else np.cumsum([0] + [a.size for a in arrays])[:-1].tolist()
    expected = np.zeros(capacity, numpy_type)
    for a, start in zip(arrays, starts, strict=True):
        expected[start : start + a.size] = a.ravel()

    bucket = cuda.to_device(np.zeros(capacity, numpy_type))
    buckets.pack(bucket, [cuda.to_device(a) for a in arrays], offsets, **grid)
    np.testing.assert_array_equal(bucket.copy_to_host(), expected)  # gaps untouched

    outs = [cuda.to_device(np.zeros(a.shape, numpy_type)) for a in arrays]
    buckets.unpack(bucket, outs, offsets, **grid)
    for out, a in zip(outs, arrays, strict=True):
        np.testing.assert_array_equal(out.copy_to_host(), a)


def test_more_arrays_than_one_launch_takes(cuda):
    count = kernels.MAX_ARRAYS_PER_LAUNCH + 6  # two launches: 64 arrays, then 6 (padded to 8)
    arrays = [np.arange(j % 4, dtype=np.int32) + 10 * j for j in range(count)]
    total = sum(a.size for a in arrays)
    bucket = cuda.device_array(total, np.int32)
    buckets.pack(bucket, [cuda.to_device(a) for a in arrays], threads=64, max_blocks=2)
    np.testing.assert_array_equal(bucket.copy_to_host(), np.concatenate(arrays))
    outs = [cuda.device_array(a.size, np.int32) for a in arrays]
    buckets.unpack(bucket, outs, threads=64, max_blocks=2)
    for out, a in zip(outs, arrays, strict=True):
        np.testing.assert_array_equal(out.copy_to_host(), a)


def test_every_function_takes_a_stream(cuda):
    stream = cuda.stream()
    a, b = cuda.to_device(np.float32([1, 2])), cuda.to_device(np.float32([3]))
    bucket = cuda.device_array(3, np.float32)
    buckets.pack(bucket, [a, b], stream=stream)
    kernels.reduce_into(bucket, cuda.to_device(np.float32([1, 1, 1])), "float32", "sum", stream=stream)
    kernels.scale(bucket, "float32", 2, divide=True, stream=stream)
    buckets.unpack(bucket, [a, b], stream=stream)
    half = cuda.device_array(3, np.uint16)
    kernels.cast(half, "bfloat16", bucket, "float32", stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(a.copy_to_host(), np.float32([1, 1.5]))
    np.testing.assert_array_equal(half.copy_to_host().view(ml_dtypes.bfloat16), np.float32([1, 1.5, 2]))


# --- launch configuration ------------------------------------------------------------------


@settings(max_examples=examples(300))
@given(n=st.integers(0, 10**12), threads=st.integers(1, 1024), max_blocks=st.integers(1, 2**31 - 1))
def test_launch_config_covers_n_with_no_idle_block(n, threads, max_blocks):
    blocks, per_block = kernels.launch_config(n, threads=threads, max_blocks=max_blocks)
    if n == 0:
        assert (blocks, per_block) == (0, 0)  # nothing to launch
        return
    assert 1 <= per_block <= threads and 1 <= blocks <= max_blocks
    assert blocks * per_block >= n or blocks == max_blocks  # one thread per element, or the loop strides
    assert (blocks - 1) * per_block < n  # every block has work
    if per_block < threads:  # a small n: whole warps, no spare one
        assert per_block % 32 == 0 and per_block - 32 < n


def test_launch_config_defaults():
    assert kernels.launch_config(1) == (1, 32)
    assert kernels.launch_config(257) == (2, 256)
    # 64 Mi float32 are 16 Mi vectors: one per thread, not one wave that loops 16 times.
    assert kernels.launch_config((64 << 20) // 4) == (65536, 256)
    assert kernels.launch_config(10**9) == (kernels.MAX_BLOCKS, kernels.THREADS_PER_BLOCK)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": -1}, "must be >= 0"),
        ({"n": 4, "threads": 0}, "1 to 1024"),
        ({"n": 4, "threads": 2048}, "1 to 1024"),
        ({"n": 4, "max_blocks": 0}, "max_blocks=0"),
    ],
)
def test_launch_config_rejects_bad_values(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        kernels.launch_config(**kwargs)


def test_reduce_into_rejects_bad_arguments(cuda):
    f32 = cuda.to_device(np.zeros(4, np.float32))
    with pytest.raises(InvalidArgument, match="not a Numba device array"):
        kernels.reduce_into(np.zeros(4, np.float32), f32, "float32")
    with pytest.raises(InvalidArgument, match="source has dtype int32 but float32"):
        kernels.reduce_into(f32, cuda.to_device(np.zeros(4, np.int32)), "float32")
    with pytest.raises(InvalidArgument, match=r"source has 3 elements .* destination has 4"):
        kernels.reduce_into(f32, cuda.to_device(np.zeros(3, np.float32)), "float32")
    with pytest.raises(InvalidArgument, match="BAND does not apply to float32"):
        kernels.reduce_into(f32, f32, "float32", ReduceOp.BAND)
    with pytest.raises(InvalidArgument, match="AVG does not apply to int32"):
        kernels.reduce_into(
            cuda.to_device(np.zeros(4, np.int32)), cuda.to_device(np.zeros(4, np.int32)), "int32", "avg"
        )
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        kernels.reduce_into(cuda.to_device(np.zeros((4, 2), np.float32))[:, 0], f32, "float32")
    with pytest.raises(InvalidArgument, match="bfloat16 data must be stored as"):
        kernels.reduce_into(f32, f32, "bfloat16")
    with pytest.raises(InvalidArgument, match="not a reduce op"):
        kernels.reduce_into(f32, f32, "float32", "mean")
    with pytest.raises(InvalidArgument, match="is not supported"):
        kernels.reduce_into(f32, f32, "complex64")


def test_cast_and_scale_reject_bad_arguments(cuda):
    f32 = cuda.to_device(np.zeros(4, np.float32))
    bits = cuda.device_array(4, np.uint16)
    with pytest.raises(InvalidArgument, match="cannot convert float64 to bfloat16; supported: float32 -> bfloat16"):
        kernels.cast(bits, "bfloat16", cuda.to_device(np.zeros(4)), "float64")
    with pytest.raises(InvalidArgument, match="source has 3 elements"):
        kernels.cast(bits, "float16", cuda.to_device(np.zeros(3, np.float32)), "float32")
    with pytest.raises(InvalidArgument, match="destination has dtype float32 but float16"):
        kernels.cast(f32, "float16", f32, "float32")
    with pytest.raises(InvalidArgument, match="int32 is not a floating dtype"):
        kernels.scale(cuda.to_device(np.zeros(4, np.int32)), "int32", 2)
    with pytest.raises(InvalidArgument, match="dividing by zero"):
        kernels.scale(f32, "float32", 0, divide=True)
    with pytest.raises(InvalidArgument, match="factor 'x' is not a number"):
        kernels.scale(f32, "float32", "x")


def test_pack_and_unpack_reject_bad_layouts(cuda):
    bucket = cuda.device_array(6, np.float32)
    two, three = cuda.to_device(np.zeros(2, np.float32)), cuda.to_device(np.zeros(3, np.float32))
    with pytest.raises(InvalidArgument, match="hold 7 elements but the bucket has room for 6"):
        buckets.pack(bucket, [two, three, two])
    with pytest.raises(InvalidArgument, match="slots of arrays 0 and 1 overlap"):
        buckets.pack(bucket, [two, three], [0, 1])
    with pytest.raises(InvalidArgument, match=r"array 1 \(3 elements at offset 4\) does not fit"):
        buckets.unpack(bucket, [two, three], [0, 4])
    with pytest.raises(InvalidArgument, match="does not fit"):
        buckets.pack(bucket, [two], [-1])
    with pytest.raises(InvalidArgument, match="1 offsets for 2 arrays"):
        buckets.pack(bucket, [two, three], [0])
    with pytest.raises(InvalidArgument, match="offsets must be integers"):
        buckets.pack(bucket, [two], [0.5])
    with pytest.raises(InvalidArgument, match="array 1 has dtype int32 but the bucket has float32"):
        buckets.pack(bucket, [two, cuda.to_device(np.zeros(2, np.int32))])
    with pytest.raises(InvalidArgument, match="array 0 is a ndarray, not a Numba device array"):
        buckets.unpack(bucket, [np.zeros(2, np.float32)])
    buckets.pack(bucket, [])  # nothing to move is not an error


def test_importing_the_module_does_not_import_numba_cuda():
    code = "import sys, ferrodist.gpu._cuda_kernels, ferrodist.gpu._cuda_buckets; print('numba.cuda' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"
