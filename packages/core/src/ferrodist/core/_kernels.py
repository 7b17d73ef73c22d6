"""CPU reduction kernels (private): plain arrays in, no validation, no allocation per element.

Every kernel has the shape ``kernel(dst, srcs, op, divisor)``: ``srcs`` is a tuple
of k one-dimensional arrays of ``dst``'s length, and the kernel writes
``dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[k-1][i]`` reading every
source once, in one pass (``dst`` may be one of the sources). Operands are combined
left to right, so a caller that passes the same tuple order gets the same bits.

float16 and bfloat16 arrive as their uint16 bit patterns: each element is widened
to float32, the k sources are combined in float32, and the result is rounded once
to nearest-even. ``divisor`` (for AVG) divides the float32/float64 result before
that single rounding. Opcodes are the values of :class:`ferrodist.core.ReduceOp`.
"""

from __future__ import annotations

import numpy as np

from ._jit import HARDWARE_HALF, bits_from_f32, f16_bits_from_f32, f32_from_bits, f32_from_f16_bits, jit

# Opcodes: the values of ReduceOp (kernels see plain ints; Numba freezes these at compile time).
SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR = range(8)


@jit(inline="always")
def _combine(a, b, op):  # type: ignore[no-untyped-def]
    # MIN and MAX propagate NaN the way numpy.minimum / numpy.maximum do.
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


#: Elements per block when ``dst`` overlaps a source (see the note above ``_int_fold``).
BLOCK = 2048


@jit(inline="always")
def _overlaps(dst, srcs):  # type: ignore[no-untyped-def]
    d0 = dst.ctypes.data
    d1 = d0 + dst.shape[0] * dst.itemsize
    for s in range(len(srcs)):
        s0 = srcs[s].ctypes.data
        if s0 < d1 and d0 < s0 + srcs[s].shape[0] * srcs[s].itemsize:
            return True
    return False


# Each fold writes ``out[i - lo]`` for i in lo..hi. LLVM vectorises a fold only after a
# run-time check that ``out`` overlaps no source; ``dst`` is often one of the sources (an
# in-place reduction), and then that check sends the whole call to the scalar loop (3-7x
# slower). So an overlapping call folds block by block into a small private buffer and
# copies each block out: both loops vectorise, and the block stays in L1.


@jit(inline="always")
def _int_fold(out, srcs, lo, hi, op, divisor):  # type: ignore[no-untyped-def]
    first = srcs[0]
    ulo, uhi = np.uint64(lo), np.uint64(hi)  # unsigned: no negative-index wrap-around, which blocks vectorising
    for u in range(ulo, uhi):
        acc = first[u]
        for s in range(1, len(srcs)):
            acc = _combine(acc, srcs[s][u], op)
        out[u - ulo] = acc


@jit(inline="always")
def _float_fold(out, srcs, lo, hi, op, divisor):  # type: ignore[no-untyped-def]
    first = srcs[0]
    ulo, uhi = np.uint64(lo), np.uint64(hi)  # unsigned: no negative-index wrap-around, which blocks vectorising
    if divisor == 1.0:
        for u in range(ulo, uhi):
            acc = first[u]
            for s in range(1, len(srcs)):
                acc = _combine_float(acc, srcs[s][u], op)
            out[u - ulo] = acc
    else:
        for u in range(ulo, uhi):
            acc = first[u]
            for s in range(1, len(srcs)):
                acc = _combine_float(acc, srcs[s][u], op)
            out[u - ulo] = acc / divisor


@jit
def reduce_int(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    """Integer (and bool viewed as uint8) reduction; wraps around like numpy (no divisor)."""
    n = dst.shape[0]
    if not _overlaps(dst, srcs):
        _int_fold(dst, srcs, 0, n, op, divisor)
        return
    block = np.empty(min(n, BLOCK), dst.dtype)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        _int_fold(block, srcs, lo, hi, op, divisor)
        ulo, uhi = np.uint64(lo), np.uint64(hi)
        for u in range(ulo, uhi):
            dst[u] = block[u - ulo]


@jit
def reduce_float(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    """float32 / float64 reduction in the array's own precision."""
    n = dst.shape[0]
    if not _overlaps(dst, srcs):
        _float_fold(dst, srcs, 0, n, op, divisor)
        return
    block = np.empty(min(n, BLOCK), dst.dtype)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        _float_fold(block, srcs, lo, hi, op, divisor)
        ulo, uhi = np.uint64(lo), np.uint64(hi)
        for u in range(ulo, uhi):
            dst[u] = block[u - ulo]


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


# float16 / bfloat16: one small kernel per op, compiled on first use. The op (and whether to
# divide) must be a compile-time constant inside the element loop: a run-time op switch
# there stops LLVM from vectorising the widen-combine-round loop (4-5x slower at k > 2).


@jit(inline="always")
def _bf16_range(out, srcs, lo, hi, op, divide, divisor):  # type: ignore[no-untyped-def]
    div = np.float32(divisor)
    first = srcs[0]
    ulo, uhi = np.uint64(lo), np.uint64(hi)  # unsigned: no negative-index wrap-around, which blocks vectorising
    for u in range(ulo, uhi):
        acc = _bf16_load(first[u])
        for s in range(1, len(srcs)):
            acc = _combine_float(acc, _bf16_load(srcs[s][u]), op)
        out[u - ulo] = _bf16_store(acc / div if divide else acc)


@jit(inline="always")
def _bf16_fold(dst, srcs, op, divide, divisor):  # type: ignore[no-untyped-def]
    n = dst.shape[0]
    if not _overlaps(dst, srcs):
        _bf16_range(dst, srcs, 0, n, op, divide, divisor)
        return
    block = np.empty(min(n, BLOCK), dst.dtype)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        _bf16_range(block, srcs, lo, hi, op, divide, divisor)
        ulo, uhi = np.uint64(lo), np.uint64(hi)
        for u in range(ulo, uhi):
            dst[u] = block[u - ulo]


@jit(inline="always")
def _f16_range(out, srcs, lo, hi, op, divide, divisor):  # type: ignore[no-untyped-def]
    div = np.float32(divisor)
    first = srcs[0]
    ulo, uhi = np.uint64(lo), np.uint64(hi)  # unsigned: no negative-index wrap-around, which blocks vectorising
    for u in range(ulo, uhi):
        acc = _f16_load(first[u])
        for s in range(1, len(srcs)):
            acc = _combine_float(acc, _f16_load(srcs[s][u]), op)
        out[u - ulo] = _f16_store(acc / div if divide else acc)


@jit(inline="always")
def _f16_fold(dst, srcs, op, divide, divisor):  # type: ignore[no-untyped-def]
    n = dst.shape[0]
    if not _overlaps(dst, srcs):
        _f16_range(dst, srcs, 0, n, op, divide, divisor)
        return
    block = np.empty(min(n, BLOCK), dst.dtype)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        _f16_range(block, srcs, lo, hi, op, divide, divisor)
        ulo, uhi = np.uint64(lo), np.uint64(hi)
        for u in range(ulo, uhi):
            dst[u] = block[u - ulo]


@jit
def bf16_sum(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _bf16_fold(dst, srcs, SUM, False, divisor)


@jit
def bf16_avg(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _bf16_fold(dst, srcs, SUM, True, divisor)


@jit
def bf16_product(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _bf16_fold(dst, srcs, PRODUCT, False, divisor)


@jit
def bf16_min(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _bf16_fold(dst, srcs, MIN, False, divisor)


@jit
def bf16_max(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _bf16_fold(dst, srcs, MAX, False, divisor)


@jit
def f16_sum(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _f16_fold(dst, srcs, SUM, False, divisor)


@jit
def f16_avg(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _f16_fold(dst, srcs, SUM, True, divisor)


@jit
def f16_product(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _f16_fold(dst, srcs, PRODUCT, False, divisor)


@jit
def f16_min(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _f16_fold(dst, srcs, MIN, False, divisor)


@jit
def f16_max(dst, srcs, op, divisor):  # type: ignore[no-untyped-def]
    _f16_fold(dst, srcs, MAX, False, divisor)


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
