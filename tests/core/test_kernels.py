"""The reduction kernels against numpy.

Example counts (CI profile): 8 per (dtype, op) pair for reduce_many, 40 for the
float16/bfloat16 single-rounding checks.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import examples
from ferrodist.core import ALL_DTYPES, InvalidArgument, ReduceOp, _kernels, dtype, reduce_into, reduce_many
from ferrodist.core.kernels import MAX_FUSED_SOURCES
from ferrodist.testing import assert_reduced, reduce_values
from ferrodist.testing.strategies import tensors

PAIRS = [(dt, op) for dt in ALL_DTYPES for op in sorted(dt.ops, key=lambda o: o.value)]
# k = 1..3 and 8 use one kernel call; 11 folds into two (8, then the partial plus 3 more).
HALVES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
SOURCE_COUNTS = st.sampled_from([1, 2, 3, 8, MAX_FUSED_SOURCES + 3])


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=[f"{d.name}-{o.name}" for d, o in PAIRS])
@settings(max_examples=examples(8))
@given(data=st.data(), k=SOURCE_COUNTS, n=st.integers(0, 70))
def test_reduce_many_matches_numpy(dt, op, data, k, n):
    bounds = {"low": -2.0, "high": 2.0} if op is ReduceOp.PRODUCT else {}
    srcs = [data.draw(tensors(dt, (n,), **bounds)) for _ in range(k)]
    before = [s.copy() for s in srcs]
    out = np.full(n, 7, dtype=dt.numpy)
    reduce_many(out, srcs, op)
    assert_reduced(out, srcs, op)
    for s, b in zip(srcs, before, strict=False):
        np.testing.assert_array_equal(s, b)  # sources are only read


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@settings(max_examples=examples(40))
@given(data=st.data(), k=st.sampled_from([2, 3, MAX_FUSED_SOURCES]), n=st.integers(1, 40))
def test_half_types_accumulate_in_float32_and_round_once(name, data, k, n):
    dt = HALVES[name]
    srcs = [data.draw(tensors(name, (n,))) for _ in range(k)]
    out = np.empty(n, dt)
    reduce_many(out, srcs, ReduceOp.SUM)
    # Exactly: the float32 sum, left to right, rounded once to nearest-even.
    wide = functools.reduce(np.add, [s.astype(np.float32) for s in srcs])
    np.testing.assert_array_equal(out.view(np.uint16), wide.astype(dt).view(np.uint16))
    reduce_many(out, srcs, ReduceOp.AVG)
    np.testing.assert_array_equal(
        out.view(np.uint16), (wide.astype(np.float64) / k).astype(np.float32).astype(dt).view(np.uint16)
    )


@pytest.mark.parametrize("name", sorted(HALVES))
def test_widening_is_exact_for_every_bit_pattern(name):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = np.empty(every.shape, np.float32)
    (_kernels.f16_to_f32 if name == "float16" else _kernels.bf16_to_f32)(wide, every)
    expected = every.view(HALVES[name]).astype(np.float32)
    nan = np.isnan(expected)
    assert (np.isnan(wide) == nan).all()
    np.testing.assert_array_equal(wide.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])


@pytest.mark.parametrize("name", sorted(HALVES))
def test_rounding_is_nearest_even_on_ties_subnormals_and_overflow(name):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    # Exact ties: float32 values halfway between two neighbours of the narrow type.
    shift = np.uint32(13 if name == "float16" else 16)
    ties = (bits & ~((np.uint32(1) << shift) - np.uint32(1))) | (np.uint32(1) << (shift - np.uint32(1)))
    values = np.concatenate([bits, ties]).view(np.float32)
    specials = np.float32([65504, 65520, 65519.99, 1e30, -1e30, 6e-8, 3e-8, 2.98e-8, 0.0, -0.0, np.inf, -np.inf])
    values = np.concatenate([values[~np.isnan(values)], specials])
    got = np.empty(values.shape, np.uint16)
    (_kernels.f32_to_f16 if name == "float16" else _kernels.f32_to_bf16)(got, values)
    with np.errstate(over="ignore"):
        expected = values.astype(HALVES[name]).view(np.uint16)
    np.testing.assert_array_equal(got, expected)
    nan_in = np.float32([np.nan, -np.nan])
    nan_out = np.empty(2, np.uint16)
    (_kernels.f32_to_f16 if name == "float16" else _kernels.f32_to_bf16)(nan_out, nan_in)
    assert np.isnan(nan_out.view(HALVES[name]).astype(np.float32)).all()


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_nan_propagates(name, op):
    dt = dtype(name)
    a = np.array([np.nan, 1.0, 2.0], dtype=np.float32).astype(dt.numpy)
    b = np.array([1.0, np.nan, 3.0], dtype=np.float32).astype(dt.numpy)
    out = np.empty(3, dt.numpy)
    reduce_many(out, [a, b], op)
    got = out.astype(np.float64)
    assert np.isnan(got[0]) and np.isnan(got[1])
    assert got[2] == reduce_values([a[2:], b[2:]], op).astype(np.float64)[0]


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
def test_destination_may_be_a_source(dt):
    srcs = [np.arange(10).astype(dt.numpy) for _ in range(3)]
    expected = reduce_values(srcs, ReduceOp.MAX)
    reduce_many(srcs[1], srcs, ReduceOp.MAX)
    np.testing.assert_array_equal(srcs[1], expected)
    many = [np.full(5, i % 2).astype(dt.numpy) for i in range(MAX_FUSED_SOURCES + 1)]
    expected = reduce_values(many, ReduceOp.SUM)
    reduce_many(many[-1], many, ReduceOp.SUM)  # a folded call whose destination is read late
    np.testing.assert_array_equal(many[-1], expected)


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=[f"{d.name}-{o.name}" for d, o in PAIRS])
def test_in_place_reduction_matches_out_of_place(dt, op):
    # The destination as each source in turn (positions 0 and 1 have compiled variants that
    # read that source through the destination; 2 goes through a temporary), at lengths
    # that end inside and after a vector of any width.
    rng = np.random.default_rng(len(PAIRS))
    for n in (1, 37, 2 * 2048 + 37):
        low, high = (-2, 3) if op is ReduceOp.PRODUCT else (-100, 100)
        srcs = [rng.integers(low, high, n).astype(dt.numpy) for _ in range(3)]
        expected = np.empty(n, dt.numpy)
        reduce_many(expected, srcs, op)
        for position in range(3):
            mine = [s.copy() for s in srcs]
            reduce_many(mine[position], mine, op)
            np.testing.assert_array_equal(mine[position].view(np.uint8), expected.view(np.uint8))
            for q in range(3):
                if q != position:
                    np.testing.assert_array_equal(mine[q], srcs[q])


def test_reduce_into_is_in_place_and_accepts_op_names():
    d = np.array([1, 5, -3], np.int32)
    reduce_into(d, np.array([4, 2, -7], np.int32), "min")
    np.testing.assert_array_equal(d, [1, 2, -7])
    f = np.array([1.0, 3.0], np.float32)
    reduce_into(f, np.array([3.0, 5.0], np.float32), ReduceOp.AVG)
    np.testing.assert_array_equal(f, [2.0, 4.0])


def test_integer_sums_wrap_around_like_numpy():
    a = np.array([127, -128, 100], np.int8)
    b = np.array([1, -1, 100], np.int8)
    out = np.empty(3, np.int8)
    reduce_many(out, [a, b], ReduceOp.SUM)
    np.testing.assert_array_equal(out, [-128, 127, -56])
    u = np.array([2**63 + 5], np.uint64)
    reduce_many(out := np.empty(1, np.uint64), [u, u], ReduceOp.SUM)
    assert out[0] == 10


def test_bool_ops_are_logical():
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    out = np.empty(4, bool)
    for op, expected in [
        (ReduceOp.SUM, a | b),
        (ReduceOp.MAX, a | b),
        (ReduceOp.PRODUCT, a & b),
        (ReduceOp.MIN, a & b),
        (ReduceOp.BXOR, a ^ b),
    ]:
        reduce_many(out, [a, b], op)
        np.testing.assert_array_equal(out, expected, err_msg=op.name)


@pytest.mark.parametrize(
    ("dst", "srcs", "op", "message"),
    [
        (np.zeros(3, np.float32), [np.zeros(3, np.float32)], ReduceOp.BAND, "BAND does not apply to float32"),
        (np.zeros(3, np.int32), [np.zeros(3, np.int32)], ReduceOp.AVG, "AVG is defined for floating dtypes"),
        (np.zeros(3, np.float32), [np.zeros(3, np.float64)], ReduceOp.SUM, "source 0 is float64"),
        (np.zeros(3, np.float32), [np.zeros(4, np.float32)], ReduceOp.SUM, "source 0 has 4 elements"),
        (np.zeros(3, np.float32), [], ReduceOp.SUM, "at least one source"),
        (np.zeros(3, np.float32), [np.zeros(3, np.float32)], "mean", "is not a reduce op"),
        (np.zeros(3, np.complex64), [np.zeros(3, np.complex64)], ReduceOp.SUM, "not supported"),
    ],
)
def test_bad_arguments_are_clear_errors(dst, srcs, op, message):
    with pytest.raises(InvalidArgument, match=message):
        reduce_many(dst, srcs, op)


def test_read_only_destination_is_refused():
    dst = np.zeros(3, np.float32)
    dst.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        reduce_into(dst, np.ones(3, np.float32))


@pytest.mark.parametrize(("setting", "frozen"), [(None, True), ("0", False)])
def test_numba_import_moves_its_objects_out_of_the_collectors_way(setting, frozen):
    """ferrodist.core._compile.jit freezes the objects Numba's import left (gc.freeze), unless
    FERRODIST_GC_FREEZE=0; a fresh interpreter shows which happened."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FERRODIST_GC_FREEZE"}
    if setting is not None:
        env["FERRODIST_GC_FREEZE"] = setting
    code = "import gc, ferrodist.core._compile.jit; print(gc.get_freeze_count())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (int(out.stdout) > 10_000) is frozen


@pytest.mark.parametrize("shift", [1, -1, 3])
def test_a_destination_that_partly_overlaps_a_source_gets_numpys_result(shift):
    """Views of one buffer, offset by a few elements: the call goes through a temporary and
    gives what numpy gives (which buffers overlapping operands)."""
    n = 1000
    buf = np.arange(n + 8, dtype=np.float32)
    other = np.linspace(0, 1, n, dtype=np.float32)
    src = buf[4 : 4 + n]
    dst = buf[4 + shift : 4 + shift + n]
    expected = np.add(src.copy(), other)
    reduce_many(dst, [src, other], ReduceOp.SUM)
    np.testing.assert_array_equal(dst, expected)
