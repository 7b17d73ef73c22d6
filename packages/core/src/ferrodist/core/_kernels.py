"""CPU reduction kernels (private; ``ferrodist.core.kernels`` is their public face).

A kernel writes ``dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[k-1][i]``: ``srcs``
is a tuple of k one-dimensional arrays of ``dst``'s length, each read once, in one pass,
combined left to right (a caller that passes the same order gets the same bits).

Everything that decides the loop is a compile-time constant: the element kind (``PLAIN``,
or float16/bfloat16 as their uint16 bits, widened to float32 and rounded once to
nearest-even), the op, whether to divide, and where ``dst`` is among the sources.
:func:`fold_kernel` makes one small compiled function per such choice (a closure over
integers, which Numba treats as literals and caches on disk); Numba specialises it further
per dtype and per k. The element loop therefore holds one op and no branch, and LLVM
vectorises it. ``dst`` either overlaps no source (``position`` -1) or *is* source
``position``: that source is then read through ``dst`` itself, so the only run-time check
LLVM adds (that ``dst`` overlaps none of the other sources) passes. ``_reduce`` compiles
positions -1, 0 and 1 (what the collectives use) and folds anything else through a
temporary.

Opcodes are the values of :class:`ferrodist.core.ReduceOp`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.extending import overload

from ._compile.helper import Recipe, made_by
from ._compile.jit import HARDWARE_HALF, bits_from_f32, f16_bits_from_f32, f32_from_bits, f32_from_f16_bits, jit

SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR = range(8)
#: Element kinds: the array's own values, or the bits of a bfloat16 / float16.
PLAIN, BF16, F16 = range(3)


def combine(a, b, op):  # type: ignore[no-untyped-def]
    """``a (op) b``. With ``op`` a compile-time constant (a global or closure integer), the
    one operation alone is compiled; otherwise a branch per op (MIN and MAX propagate NaN
    the way ``numpy.minimum`` / ``numpy.maximum`` do; bitwise ops for integers only)."""


def _literal(value: Any) -> int | None:
    return int(value.literal_value) if isinstance(value, types.IntegerLiteral) else None


@overload(combine, inline="always", prefer_literal=True)
def _combine_typed(a, b, op):  # type: ignore[no-untyped-def]
    code = _literal(op)
    floating = isinstance(a, types.Float)
    if code is None:
        return (lambda a, b, op: _combine_float(a, b, op)) if floating else (lambda a, b, op: _combine(a, b, op))
    if code in (SUM, AVG):
        return lambda a, b, op: a + b
    if code == PRODUCT:
        return lambda a, b, op: a * b
    if code == MIN:
        return lambda a, b, op: a if (a <= b or a != a) else b
    if code == MAX:
        return lambda a, b, op: a if (a >= b or a != a) else b
    if floating:
        raise TypingError(f"combine: opcode {code} does not apply to {a}")
    if code == BAND:
        return lambda a, b, op: a & b
    if code == BOR:
        return lambda a, b, op: a | b
    return lambda a, b, op: a ^ b


@jit(inline="always")
def _combine(a, b, op):  # type: ignore[no-untyped-def]
    if op == SUM:
        return a + b
    if op == PRODUCT:
        return a * b
    if op == MIN:
        return a if (a <= b or a != a) else b
    if op == MAX:
        return a if (a >= b or a != a) else b
    if op == BAND:
        return a & b
    if op == BOR:
        return a | b
    return a ^ b


@jit(inline="always")
def _combine_float(a, b, op):  # type: ignore[no-untyped-def]
    if op == SUM:
        return a + b
    if op == PRODUCT:
        return a * b
    if op == MIN:
        return a if (a <= b or a != a) else b
    return a if (a >= b or a != a) else b


def load(x, kind):  # type: ignore[no-untyped-def]
    """The value an element holds: ``x`` itself (``PLAIN``), or the float32 of bfloat16 /
    float16 bits (``BF16``, ``F16``). ``kind`` must be a compile-time constant."""


@overload(load, inline="always", prefer_literal=True)
def _load_typed(x, kind):  # type: ignore[no-untyped-def]
    code = _literal(kind)
    if code == BF16:
        return lambda x, kind: _bf16_load(x)
    if code == F16:
        return lambda x, kind: _f16_load(x)
    if code == PLAIN:
        return lambda x, kind: x
    raise TypingError(f"load: kind must be a compile-time PLAIN, BF16 or F16, not {kind}")


def store(x, kind):  # type: ignore[no-untyped-def]
    """What to write for value ``x``: ``x`` (``PLAIN``; the assignment converts), or its
    bfloat16 / float16 bits rounded to nearest-even (``BF16``, ``F16``)."""


@overload(store, inline="always", prefer_literal=True)
def _store_typed(x, kind):  # type: ignore[no-untyped-def]
    code = _literal(kind)
    if code == BF16:
        return lambda x, kind: _bf16_store(x)
    if code == F16:
        return lambda x, kind: _f16_store(x)
    if code == PLAIN:
        return lambda x, kind: x
    raise TypingError(f"store: kind must be a compile-time PLAIN, BF16 or F16, not {kind}")


def finish(acc, divisor, divide, kind):  # type: ignore[no-untyped-def]
    """``acc / divisor`` when ``divide`` (a compile-time 0 or 1), in float32 for the 16-bit
    kinds and in float64 for ``PLAIN`` floats (rounded once when stored); else ``acc``."""


@overload(finish, inline="always", prefer_literal=True)
def _finish_typed(acc, divisor, divide, kind):  # type: ignore[no-untyped-def]
    if not _literal(divide):
        return lambda acc, divisor, divide, kind: acc
    if _literal(kind) in (BF16, F16):
        return lambda acc, divisor, divide, kind: acc / np.float32(divisor)
    return lambda acc, divisor, divide, kind: acc / divisor


@functools.cache
def fold_kernel(kind: int, op: int, divide: bool, position: int) -> Any:
    """The compiled ``kernel(dst, srcs, divisor)`` for one element kind, opcode (AVG folds as
    SUM; pass ``divide``), and place of ``dst``: -1 (it overlaps no source) or the index of
    the source it is. ``srcs`` is a tuple of 1 to ``MAX_FUSED_SOURCES`` arrays."""
    divides = int(divide)

    def kernel(dst, srcs, divisor):  # type: ignore[no-untyped-def]
        n = np.uint64(dst.shape[0])  # unsigned: no negative-index wrap-around, which blocks vectorising
        for u in range(np.uint64(0), n):
            # The source that is dst is read through dst (the branches fold away: position
            # is a constant and LLVM unrolls the loop over the tuple).
            acc = load(dst[u], kind) if position == 0 else load(srcs[0][u], kind)
            for s in range(1, len(srcs)):
                x = load(dst[u], kind) if s == position else load(srcs[s][u], kind)
                acc = combine(acc, x, op)
            dst[u] = store(finish(acc, divisor, divides, kind), kind)

    # A name of its own per variant. Numba names compiled code "qualified name $ a counter
    # of this process", and a cached caller (shm's pipelines) carries its callee's code
    # under that name: in a process where another variant got the same name first, the
    # cached caller was linked to that variant's code (rank 0's all_reduce then folded
    # its own data twice). Distinct names keep every variant apart, in every process.
    kernel.__name__ = kernel.__qualname__ = f"fold_kernel_{kind}_{op}_{divides}_{position + 1}"
    return made_by(jit(kernel), Recipe(__name__, "fold_kernel", (kind, op, divide, position)))


@jit(inline="always")
def _bf16_load(h):  # type: ignore[no-untyped-def]
    return f32_from_bits(np.int64(h) << 16)


@jit(inline="always")
def _bf16_store(x):  # type: ignore[no-untyped-def]
    bits = bits_from_f32(np.float32(x))
    if (bits & 0x7FFFFFFF) > 0x7F800000:  # NaN: keep it a (quiet) NaN after truncation
        return np.uint16((bits >> 16) | 0x40)
    return np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)


@jit(inline="always")
def _f16_load(h):  # type: ignore[no-untyped-def]
    if HARDWARE_HALF:  # a compile-time constant: one of the two ways is compiled
        return f32_from_f16_bits(np.uint16(h))  # a NaN comes out quietened (see f16_to_f32)
    # Shift exponent and mantissa into float32 position, then fix up the exponent.
    body = (np.int64(h) & 0x7FFF) << 13
    exponent = body & 0x0F800000
    body += (127 - 15) << 23
    if exponent == 0x0F800000:  # inf / nan
        value = f32_from_bits(body + ((128 - 16) << 23))
    elif exponent == 0:  # zero / subnormal: renormalise through a float subtraction
        value = f32_from_bits(body + (1 << 23)) - f32_from_bits(113 << 23)
    else:
        value = f32_from_bits(body)
    if np.int64(h) & 0x8000:
        return -value
    return value


@jit(inline="always")
def _f16_store(x):  # type: ignore[no-untyped-def]
    if HARDWARE_HALF:
        half = f16_bits_from_f32(np.float32(x))
        if (half & 0x7FFF) > 0x7C00:  # NaN: the canonical quiet NaN, as the software way gives
            return np.uint16((half & 0x8000) | 0x7E00)
        return half
    bits = bits_from_f32(np.float32(x))
    sign = (bits >> 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    if mag >= (127 + 16) << 23:  # overflows float16, or inf / nan
        out = 0x7E00 if mag > 0x7F800000 else 0x7C00
    elif mag < 113 << 23:  # result is a float16 subnormal (or zero)
        magic = ((127 - 15) + (23 - 10) + 1) << 23
        out = bits_from_f32(f32_from_bits(mag) + f32_from_bits(magic)) - magic
    else:  # normal: rebias the exponent and round the mantissa to nearest-even
        odd = (mag >> 13) & 1
        out = (mag + ((15 - 127) << 23) + 0xFFF + odd) >> 13
    return np.uint16(out | sign)


@jit
def f32_to_f16(dst, src):  # type: ignore[no-untyped-def]
    """Round float32 values to float16 bit patterns (nearest-even)."""
    for i in range(dst.shape[0]):
        dst[i] = _f16_store(src[i])


@jit
def f32_to_bf16(dst, src):  # type: ignore[no-untyped-def]
    """Round float32 values to bfloat16 bit patterns (nearest-even)."""
    for i in range(dst.shape[0]):
        dst[i] = _bf16_store(src[i])


@jit
def f16_to_f32(dst, src):  # type: ignore[no-untyped-def]
    """Widen float16 bit patterns to float32, NaN payloads kept bit for bit (as numpy does;
    the reductions need not: their results round through ``_f16_store``)."""
    for i in range(dst.shape[0]):
        h = np.int64(src[i])
        if (h & 0x7FFF) > 0x7C00:
            dst[i] = f32_from_bits(((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13))
        else:
            dst[i] = _f16_load(src[i])


@jit
def bf16_to_f32(dst, src):  # type: ignore[no-untyped-def]
    for i in range(dst.shape[0]):
        dst[i] = _bf16_load(src[i])
