"""float16 and bfloat16 in the shared-memory loops: the fold that accumulates 16-bit floats
in float32 blocks and rounds once (the kernels' bits), and for ``all_reduce(...,
compress="bf16")`` the moves that round float32 into bfloat16 slots and widen it back, the
two-rank fold that rounds this rank's own block on the fly, and where the fold reads that
block. Inlined into ``loops``' chunk loops; each is typed by its overload, so an array of
another dtype never compiles a 16-bit path."""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from ferrodist.core.kernels import BF16, F16, SUM, combine, copy_into, load, store

from .slots import source

__all__ = ["HALF_BLOCK", "fold_halves_block", "fold_rounded_pair", "move", "own_source"]

#: Elements per float32 accumulator block of the large float16/bfloat16 fold.
HALF_BLOCK = 2048


def fold_halves_block(out, x, part, data, me, s, slots, chunk, m, b0, b1, p, op, divisor, half, acc):  # type: ignore[no-untyped-def]
    """``out`` = block b0:b1 of every rank's chunk (this rank's from ``part``, the others'
    from their slots), 16-bit float bits combined in float32 in rank order and rounded
    once, ``HALF_BLOCK`` elements at a time: the fused kernels' bits. Typed by the overload
    below: arrays of other dtypes never take this path."""


@overload(fold_halves_block)
def _fold_halves_block_typed(out, x, part, data, me, s, slots, chunk, m, b0, b1, p, op, divisor, half, acc):  # type: ignore[no-untyped-def]
    if not isinstance(out, types.Array) or out.dtype != types.uint16:
        return lambda out, x, part, data, me, s, slots, chunk, m, b0, b1, p, op, divisor, half, acc: None

    def fold(out, x, part, data, me, s, slots, chunk, m, b0, b1, p, op, divisor, half, acc):  # type: ignore[no-untyped-def]
        # The loops are written out per type and per division on purpose: with ``half`` or
        # the division tested inside one loop, LLVM kept the test in the loop and a 64 MiB
        # bfloat16 all_reduce took 70 ms instead of 17.
        if p == 2 and op == SUM:  # one fused pass, as fast as the kernels
            a = source(data, x, part, me, 0, s, slots, chunk, m)[b0:b1]
            b = source(data, x, part, me, 1, s, slots, chunk, m)[b0:b1]
            div = np.float32(divisor)
            k = np.uint64(b1 - b0)
            if half == BF16:
                if divisor != 1.0:
                    for u in range(k):
                        out[u] = store((load(a[u], BF16) + load(b[u], BF16)) / div, BF16)
                else:
                    for u in range(k):
                        out[u] = store(load(a[u], BF16) + load(b[u], BF16), BF16)
            elif divisor != 1.0:
                for u in range(k):
                    out[u] = store((load(a[u], F16) + load(b[u], F16)) / div, F16)
            else:
                for u in range(k):
                    out[u] = store(load(a[u], F16) + load(b[u], F16), F16)
            return
        for lo in range(b0, b1, HALF_BLOCK):
            hi = min(lo + HALF_BLOCK, b1)
            k = np.uint64(hi - lo)
            first = source(data, x, part, me, 0, s, slots, chunk, m)[lo:hi]
            if half == BF16:
                for u in range(k):
                    acc[u] = load(first[u], BF16)
            else:
                for u in range(k):
                    acc[u] = load(first[u], F16)
            for q in range(1, p):
                src = source(data, x, part, me, q, s, slots, chunk, m)[lo:hi]
                if half == BF16:
                    if op == SUM:  # the common op gets a loop of its own, which vectorises
                        for u in range(k):
                            acc[u] += load(src[u], BF16)
                    else:
                        for u in range(k):
                            acc[u] = combine(acc[u], load(src[u], BF16), op)
                elif op == SUM:
                    for u in range(k):
                        acc[u] += load(src[u], F16)
                else:
                    for u in range(k):
                        acc[u] = combine(acc[u], load(src[u], F16), op)
            o = out[lo - b0 : hi - b0]
            div = np.float32(divisor)
            if half == BF16:
                if divisor != 1.0:
                    for u in range(k):
                        o[u] = store(acc[u] / div, BF16)
                else:
                    for u in range(k):
                        o[u] = store(acc[u], BF16)
            elif divisor != 1.0:
                for u in range(k):
                    o[u] = store(acc[u] / div, F16)
            else:
                for u in range(k):
                    o[u] = store(acc[u], F16)

    return fold


def move(dst, src):  # type: ignore[no-untyped-def]
    """``dst`` = ``src``, between ``x``'s elements and a slot's: a copy, float32 rounded to
    bfloat16 (into a slot), or bfloat16 widened to float32 (out of one)."""


@overload(move, inline="always")
def _move_typed(dst, src):  # type: ignore[no-untyped-def]
    if dst.dtype == src.dtype:
        return lambda dst, src: copy_into(dst, src)
    if dst.dtype == types.uint16:

        def rounded(dst, src):  # type: ignore[no-untyped-def]
            for u in range(np.uint64(dst.shape[0])):
                dst[u] = store(src[u], BF16)

        return rounded

    def widened(dst, src):  # type: ignore[no-untyped-def]
        for u in range(np.uint64(dst.shape[0])):
            dst[u] = load(src[u], BF16)

    return widened


def fold_rounded_pair(out, mine, other, divisor):  # type: ignore[no-untyped-def]
    """Two ranks' SUM (or AVG) of float32 ``mine`` rounded to bfloat16 and the bfloat16
    bits ``other`` into ``out``: what ``fold_halves_block`` gives for the rounded ``mine``
    (the sum of two is the same either way round), without a pass to round it first."""


@overload(fold_rounded_pair, inline="always")
def _fold_rounded_pair_typed(out, mine, other, divisor):  # type: ignore[no-untyped-def]
    if mine.dtype == out.dtype:  # not a rounded call: never reached
        return lambda out, mine, other, divisor: None

    def fold(out, mine, other, divisor):  # type: ignore[no-untyped-def]
        k = np.uint64(out.shape[0])
        if divisor != 1.0:
            div = np.float32(divisor)
            for u in range(k):
                out[u] = store((load(store(mine[u], BF16), BF16) + load(other[u], BF16)) / div, BF16)
        else:
            for u in range(k):
                out[u] = store(load(store(mine[u], BF16), BF16) + load(other[u], BF16), BF16)

    return fold


def own_source(part, rounded):  # type: ignore[no-untyped-def]
    """This rank's source in the fold: its chunk of ``x``, or (``x`` wider than the slots)
    that chunk rounded into ``rounded``."""


@overload(own_source, inline="always")
def _own_typed(part, rounded):  # type: ignore[no-untyped-def]
    if part.dtype == rounded.dtype:
        return lambda part, rounded: part
    return lambda part, rounded: rounded
