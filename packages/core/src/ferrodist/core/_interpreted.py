"""The reductions in numpy, bit for bit what the compiled kernels write.

``reducer`` runs :func:`fold` while the compiled kernel for a call's types is compiling in
the background (see ``_compile.background``). It does what ``_kernels.fold_kernel`` does, in the same
order and precision:

- plain dtypes: the sources combined left to right in the array's own dtype (integers wrap
  as the kernels' wider accumulators do once stored: sums, products and bit operations are
  exact modulo 2**bits); MIN and MAX pick an operand exactly as ``combine`` does (the
  first when it is NaN or not past the second); AVG divides the float sum by the divisor
  in float64 and rounds once to the dtype;
- float16 and bfloat16 (their uint16 bits): widened to float32 exactly, combined in float32,
  divided in float32, rounded once to nearest-even; a NaN result is bfloat16's truncated
  quiet NaN, or float16's canonical quiet NaN of its sign.

Slower than the kernels (a temporary per source), never different: the tests compare the
two over every 16-bit pattern and random bits of every dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._kernels import BAND, BF16, BOR, BXOR, MAX, MIN, PLAIN, PRODUCT, SUM

Array = np.ndarray[Any, Any]

__all__ = ["bf16_narrow", "bf16_widen", "fold"]


def fold(kind: int, opcode: int, divide: bool, dst: Array, srcs: Sequence[Array], divisor: float) -> None:
    """``dst`` = what ``fold_kernel(kind, opcode, divide, position)(dst, srcs, divisor)``
    writes, for any ``position`` (``dst`` may be one of the sources). AVG comes as SUM with
    ``divide``."""
    with np.errstate(all="ignore"):  # the kernels overflow to inf and compare NaNs silently too
        if kind == PLAIN:
            acc = np.array(srcs[0], copy=True)
            for src in srcs[1:]:
                acc = _combine(acc, src, opcode)
            if divide:
                acc = acc.astype(np.float64) / divisor  # float32 / float64 in the kernel: float64, rounded once
            dst[...] = acc
            return
        widen, narrow = (bf16_widen, bf16_narrow) if kind == BF16 else (_f16_widen, _f16_narrow)
        acc = widen(srcs[0])
        for src in srcs[1:]:
            acc = _combine(acc, widen(src), opcode)
        if divide:
            acc = acc / np.float32(divisor)
        dst[...] = narrow(acc)


def _combine(a: Array, b: Array, opcode: int) -> Array:
    """``combine(a, b, op)`` element-wise (``_kernels.combine``)."""
    if opcode == SUM:
        return a + b
    if opcode == PRODUCT:
        return a * b
    if opcode == MIN:
        return np.where((a <= b) | (a != a), a, b)
    if opcode == MAX:
        return np.where((a >= b) | (a != a), a, b)
    if opcode == BAND:
        return a & b
    if opcode == BOR:
        return a | b
    if opcode == BXOR:
        return a ^ b
    raise ValueError(f"no opcode {opcode}")


def bf16_widen(bits: Array) -> Array:
    """float32 values of bfloat16 bits (uint16), exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_narrow(values: Array) -> Array:
    """bfloat16 bits (uint16) of float32 values, rounded to nearest-even (``_kernels._bf16_store``)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def _f16_widen(bits: Array) -> Array:
    return bits.view(np.float16).astype(np.float32)


def _f16_narrow(values: Array) -> Array:
    values = values.astype(np.float32)
    half = values.astype(np.float16).view(np.uint16)
    sign = ((values.view(np.uint32) >> 16) & 0x8000).astype(np.uint16)
    return np.where(np.isnan(values), sign | np.uint16(0x7E00), half).astype(np.uint16)
