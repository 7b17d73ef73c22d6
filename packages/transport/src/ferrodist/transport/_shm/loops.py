"""The shared-memory pipelines as compiled loops (no Python per chunk).

Every collective of ``ShmCollectives`` but gather/scatter runs here: :func:`all_reduce`
(and reduce), :func:`broadcast`, :func:`all_gather` and :func:`reduce_scatter`. An
all_reduce runs each chunk in three phases:

    0  wait until the slot is free everywhere; copy into this rank's slot the blocks
       other ranks reduce; publish COPIED
    1  wait for every rank's COPIED; check that they are in this call; fold this rank's
       block from ``x`` and the peers' slots into its slot, in rank order; copy the
       result back into ``x``; publish REDUCED
    2  wait for every rank's REDUCED; copy the other blocks from their owners' slots;
       publish GATHERED

Each function runs its loop until the end, or until it would have to block: a wait that
spinning did not satisfy (``WAIT``), a peer that sleeps and must be woken after a publish
(``WAKE``), or a peer in another call (``MISMATCH``). It then returns, with where it
stopped in ``state``; the caller does what needs Python (a futex sleep bounded by the
deadline, a health check, a wake-up, the error) and calls it again.

Sources are folded two at a time in the array's own precision, which gives the same bits
as the reduction kernels; float16/bfloat16, and float32 sent as bfloat16, fold through
``halves``. Where a chunk lies in the slots is ``slots``'.
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import overload

from ferrodist.core.kernels import (
    BAND,
    BOR,
    BXOR,
    MAX,
    MIN,
    PLAIN,
    PRODUCT,
    SUM,
    copy_into,
    fold_kernel,
    jit,
    store_release,
)

from .arena import CALL, CALL_NUMBER, COPIED, COUNTERS, GATHERED, LINE, REDUCED
from .halves import HALF_BLOCK, fold_halves_block, fold_rounded_pair, move, own_source
from .slots import bounds, slot, source
from .spin import first_different, publish, spin_until

__all__ = [
    "DONE",
    "MISMATCH",
    "STATE",
    "WAIT",
    "WAKE",
    "all_gather",
    "all_reduce",
    "all_reduce_rounded",
    "all_reduce_small",
    "all_reduce_small_start",
    "broadcast",
    "reduce_scatter",
]

DONE, WAIT, WAKE, MISMATCH = range(4)
#: ``state`` words: next element, next chunk number, phase, and for a return other than
#: DONE: the counter to wait for / wake, its target value, the slot of the chunk, and the
#: ranks waited for / checked (FIRST .. STOP-1).
LO, CHUNK, PHASE, WHICH, TARGET, SLOT, FIRST, STOP = range(8)
#: Then the call's parameters, set by the caller (few arguments keep Numba's dispatch
#: cheap, about 0.2 us per argument): this rank, ranks, slots per rank, bytes per slot,
#: spins before a wait returns, opcode, root (-1: none), fingerprint (its 64 bits).
ME, RANKS, SLOTS, BYTES, SPINS, OP, ROOT, CALL_ID = range(8, 16)
#: For :func:`all_reduce_small` and :func:`all_reduce`: 0, or the 16-bit float type of
#: ``x``'s bits (BF16, F16).
HALF = 16
#: The call's number on its group, plus one (with the fingerprint, the call's identity).
NUMBER = 17
STATE = 18

_WORDS = LINE // 8
_STRIDE = COUNTERS * _WORDS  # words between two ranks' copies of one counter


def _fold(out, a, b, op, divisor):  # type: ignore[no-untyped-def]
    """``out = (a op b) / divisor`` (no division when ``divisor`` is 1); ``out`` overlaps
    neither source. Typed by the overload below."""


def _fold_in(out, b, op, divisor):  # type: ignore[no-untyped-def]
    """``out = (out op b) / divisor`` (no division when ``divisor`` is 1)."""


def _pair_kernels(floating: bool, position: int) -> tuple[Any, ...]:
    """core's two-source kernels, one per (op, division), for ``dst`` at ``position``."""
    ops = (SUM, PRODUCT, MIN, MAX) if floating else (SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR)
    return (fold_kernel(PLAIN, SUM, floating, position), *(fold_kernel(PLAIN, op, False, position) for op in ops))


@functools.cache
def _pair_dispatch(floating: bool, position: int) -> Any:
    """The implementation of :func:`_fold` / :func:`_fold_in`: the run-time op picks one of
    core's compiled two-source kernels (a call, not an inlined loop: each kernel is compiled
    once per dtype and shared with ``ferrodist.core``'s reductions, and its loop has the op
    as a constant, so it vectorises)."""
    avg, add, mul, low, high, *bits = _pair_kernels(floating, position)
    if floating:

        def fold(out, srcs, op, divisor):  # type: ignore[no-untyped-def]
            if op == SUM:
                if divisor != 1.0:
                    avg(out, srcs, divisor)
                else:
                    add(out, srcs, divisor)
            elif op == PRODUCT:
                mul(out, srcs, divisor)
            elif op == MIN:
                low(out, srcs, divisor)
            else:
                high(out, srcs, divisor)

        return numba.njit(inline="always")(fold)
    band, bor, bxor = bits

    def fold_bits(out, srcs, op, divisor):  # type: ignore[no-untyped-def]
        if op == SUM:
            add(out, srcs, divisor)
        elif op == PRODUCT:
            mul(out, srcs, divisor)
        elif op == MIN:
            low(out, srcs, divisor)
        elif op == MAX:
            high(out, srcs, divisor)
        elif op == BAND:
            band(out, srcs, divisor)
        elif op == BOR:
            bor(out, srcs, divisor)
        else:
            bxor(out, srcs, divisor)

    return numba.njit(inline="always")(fold_bits)


@overload(_fold)
def _fold_typed(out, a, b, op, divisor):  # type: ignore[no-untyped-def]
    fold = _pair_dispatch(isinstance(out.dtype, types.Float), -1)
    return lambda out, a, b, op, divisor: fold(out, (a, b), op, divisor)


@overload(_fold_in)
def _fold_in_typed(out, b, op, divisor):  # type: ignore[no-untyped-def]
    fold = _pair_dispatch(isinstance(out.dtype, types.Float), 0)
    return lambda out, b, op, divisor: fold(out, (out, b), op, divisor)


@jit(inline="always")
def _advance(words, me, which, value, p):  # type: ignore[no-untyped-def]
    """Publish this rank's counter; True if a rank may be asleep and needs waking."""
    return publish(words, (me * COUNTERS + which) * _WORDS, value, _STRIDE, which * _WORDS + 1, p)


@jit(inline="always")
def _reached(words, which, target, first, stop, spins):  # type: ignore[no-untyped-def]
    return spin_until(words, _STRIDE, which * _WORDS, first, stop, target, spins) < 0


@jit(inline="always")
def _other_call(words, s, first, stop, fingerprint, number):  # type: ignore[no-untyped-def]
    """Whether one of ranks first..stop-1 published another call (another fingerprint or
    another call number) for the chunk in slot s."""
    if fingerprint != 0 and first_different(words, _STRIDE, CALL * _WORDS + 2 + s, first, stop, fingerprint) >= 0:
        return True
    return first_different(words, _STRIDE, CALL_NUMBER * _WORDS + 2 + s, first, stop, number) >= 0


@jit(inline="always")
def _claim(words, me, s, fingerprint, number):  # type: ignore[no-untyped-def]
    """Say which call this rank's chunk in slot s belongs to (published by the next release)."""
    store_release(words, (me * COUNTERS + CALL_NUMBER) * _WORDS + 2 + s, number)
    store_release(words, (me * COUNTERS + CALL) * _WORDS + 2 + s, fingerprint)


@jit(inline="always")
def _params(state):  # type: ignore[no-untyped-def]
    return (
        state[ME],
        state[RANKS],
        state[SLOTS],
        state[BYTES],
        state[SPINS],
        state[OP],
        state[ROOT],
        np.uint64(state[CALL_ID]),
        np.uint64(state[NUMBER]),
    )


@jit(inline="always")
def _stop(state, lo, g, phase, which, target, s, first, stop, status):  # type: ignore[no-untyped-def]
    state[LO], state[CHUNK], state[PHASE] = lo, g, phase
    state[WHICH], state[TARGET], state[SLOT], state[FIRST], state[STOP] = which, target, s, first, stop
    return status


@jit
def all_reduce(x, data, words, state, divisor):  # type: ignore[no-untyped-def]
    """Run (or resume, from ``state``) the chunk loop of an all_reduce (``root < 0``) or a
    reduce to ``root`` over the flat array ``x``; returns DONE, WAIT, WAKE or MISMATCH.
    float16/bfloat16 (``state[HALF]``, ``x`` their bits) accumulate in float32."""
    return _chunk_loop(x, x[:0], data, words, state, divisor)


@jit
def all_reduce_rounded(x, rounded, data, words, state, divisor):  # type: ignore[no-untyped-def]
    """:func:`all_reduce` of the float32 array ``x`` rounded to bfloat16 (``state[HALF]`` is
    BF16): the slots hold bfloat16 and are chunked as a bfloat16 array of ``x``'s length
    would be, so the ranks exchange what :func:`all_reduce` of ``x``'s rounded bits would,
    and ``x`` ends with the widened result. ``x`` is read once and written once, each
    element rounded on its way into a slot and widened on its way back. ``rounded``: a
    chunk's bfloat16 elements (uint16), the caller's, kept across the loop's returns: this
    rank's own block, rounded before the peers are waited for, is folded from there."""
    return _chunk_loop(x, rounded, data, words, state, divisor)


@jit(inline="always")
def _chunk_loop(x, wire, data, words, state, divisor):  # type: ignore[no-untyped-def]
    """The body of :func:`all_reduce` (``wire`` is ``x[:0]``) and :func:`all_reduce_rounded`
    (``wire`` a bfloat16 buffer of a chunk, where this rank's own block is rounded)."""
    me, p, slots, chunk, spins, op, root, fingerprint, number = _params(state)
    n = x.shape[0]
    per = chunk // wire.itemsize
    lo, g, phase = state[LO], state[CHUNK], state[PHASE]
    gather = root < 0 or root == me
    half = state[HALF]  # 0, or the slots hold float16/bfloat16 bits (BF16, F16): float32 accumulation
    acc = np.empty(HALF_BLOCK if half else 0, np.float32)
    rounded = wire.itemsize != x.itemsize  # x is float32, the slots bfloat16
    pair = rounded and p == 2 and op == SUM  # this rank's block rounded inside the fold
    while lo < n:
        m = min(per, n - lo)
        s = g % slots
        part = x[lo : lo + m]
        mine = slot(data, wire, me, s, slots, chunk, m)
        b0, b1 = bounds(m, p, me)
        own = own_source(part, wire[:m])
        if phase == 0:
            if g >= slots and not _reached(words, GATHERED, g - slots + 1, 0, p, spins):
                return _stop(state, lo, g, 0, GATHERED, g - slots + 1, s, 0, p, WAIT)
            _claim(words, me, s, fingerprint, number)
            for q in range(p):
                c0, c1 = bounds(m, p, q)
                if q != me:
                    move(mine[c0:c1], part[c0:c1])
                elif rounded and not pair:  # rounded where the fold reads it
                    move(own[c0:c1], part[c0:c1])
            phase = 1
            if _advance(words, me, COPIED, g + 1, p):
                return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, WAKE)
        if phase == 1:
            if not _reached(words, COPIED, g + 1, 0, p, spins):
                return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, WAIT)
            if _other_call(words, s, 0, p, fingerprint, number):
                return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, MISMATCH)
            out = mine[b0:b1]
            if pair:
                fold_rounded_pair(out, part[b0:b1], slot(data, wire, 1 - me, s, slots, chunk, m)[b0:b1], divisor)
            elif half:
                fold_halves_block(out, wire, own, data, me, s, slots, chunk, m, b0, b1, p, op, divisor, half, acc)
            else:
                first = source(data, wire, own, me, 0, s, slots, chunk, m)[b0:b1]
                second = source(data, wire, own, me, 1, s, slots, chunk, m)[b0:b1]
                _fold(out, first, second, op, divisor if p == 2 else 1.0)
                for q in range(2, p):
                    _fold_in(
                        out,
                        source(data, wire, own, me, q, s, slots, chunk, m)[b0:b1],
                        op,
                        divisor if q == p - 1 else 1.0,
                    )
            if gather:
                move(part[b0:b1], out)
            phase = 2
            if _advance(words, me, REDUCED, g + 1, p):
                return _stop(state, lo, g, 2, REDUCED, g + 1, s, 0, p, WAKE)
        if gather:
            if not _reached(words, REDUCED, g + 1, 0, p, spins):
                return _stop(state, lo, g, 2, REDUCED, g + 1, s, 0, p, WAIT)
            for q in range(p):
                if q != me:
                    c0, c1 = bounds(m, p, q)
                    move(part[c0:c1], slot(data, wire, q, s, slots, chunk, m)[c0:c1])
        lo += m
        g += 1
        phase = 0
        if _advance(words, me, GATHERED, g, p):
            return _stop(state, lo, g, 0, GATHERED, g, s, 0, p, WAKE)
    return _stop(state, lo, g, 0, 0, 0, 0, 0, 0, DONE)


@jit
def all_reduce_small(x, data, words, state, divisor):  # type: ignore[no-untyped-def]
    """An all_reduce that fits one slot: every rank copies ``x`` into its slot and, after one
    wait, folds every rank's slot into ``x`` in rank order (the same bits everywhere).
    float16/bfloat16 (``state[HALF]``, ``x`` their bits) accumulate in float32."""
    me, p, slots, chunk, spins, op, _, fingerprint, number = _params(state)
    n = x.shape[0]
    g, phase = state[CHUNK], state[PHASE]
    s = g % slots
    if phase == 0:
        if g >= slots and not _reached(words, GATHERED, g - slots + 1, 0, p, spins):
            return _stop(state, 0, g, 0, GATHERED, g - slots + 1, s, 0, p, WAIT)
        _claim(words, me, s, fingerprint, number)
        copy_into(slot(data, x, me, s, slots, chunk, n), x)
        phase = 1
        if _advance(words, me, COPIED, g + 1, p):
            return _stop(state, 0, g, 1, COPIED, g + 1, s, 0, p, WAKE)
    if phase == 1:
        if not _reached(words, COPIED, g + 1, 0, p, spins):
            return _stop(state, 0, g, 1, COPIED, g + 1, s, 0, p, WAIT)
        if _other_call(words, s, 0, p, fingerprint, number):
            return _stop(state, 0, g, 1, COPIED, g + 1, s, 0, p, MISMATCH)
        if state[HALF]:  # every rank's slot, its own included, into x, a block at a time
            acc = np.empty(0 if p == 2 and op == SUM else HALF_BLOCK, np.float32)
            own = slot(data, x, me, s, slots, chunk, n)
            fold_halves_block(x, x, own, data, me, s, slots, chunk, n, 0, n, p, op, divisor, state[HALF], acc)
        else:
            first = slot(data, x, 0, s, slots, chunk, n)
            _fold(x, first, slot(data, x, 1, s, slots, chunk, n), op, divisor if p == 2 else 1.0)
            for q in range(2, p):
                _fold_in(x, slot(data, x, q, s, slots, chunk, n), op, divisor if q == p - 1 else 1.0)
        g += 1
        if _advance(words, me, GATHERED, g, p):
            return _stop(state, n, g, 2, GATHERED, g, s, 0, p, WAKE)
    return _stop(state, n, g, 2, 0, 0, 0, 0, 0, DONE)


@jit
def all_reduce_small_start(x, data, words, state, divisor, chunk, op, half, call_id, number):  # type: ignore[no-untyped-def]
    """:func:`all_reduce_small` from its start, the call's state words written here from
    the arguments (five scalar arguments cost less to pass than Python's eight item stores)."""
    state[LO], state[PHASE], state[CHUNK] = 0, 0, chunk
    state[OP], state[ROOT], state[HALF] = op, -1, half
    state[CALL_ID], state[NUMBER] = call_id, number
    return all_reduce_small(x, data, words, state, divisor)


@jit
def broadcast(x, data, words, state):  # type: ignore[no-untyped-def]
    """Per chunk: the root copies it into its slot; the others copy it out. Every rank
    publishes its call for every chunk, and on the last one checks every rank's (so that
    ranks naming different roots all raise instead of returning different data)."""
    me, p, slots, chunk, spins, _, root, fingerprint, number = _params(state)
    n = x.shape[0]
    per = chunk // x.itemsize
    lo, g, phase = state[LO], state[CHUNK], state[PHASE]
    while lo < n:
        m = min(per, n - lo)
        s = g % slots
        part = x[lo : lo + m]
        if phase == 0:
            if g >= slots and not _reached(words, GATHERED, g - slots + 1, 0, p, spins):
                return _stop(state, lo, g, 0, GATHERED, g - slots + 1, s, 0, p, WAIT)
            _claim(words, me, s, fingerprint, number)
            if me == root:
                copy_into(slot(data, x, me, s, slots, chunk, m), part)
            phase = 1
            if _advance(words, me, COPIED, g + 1, p):  # the root: the chunk is there; others: arrived
                return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, WAKE)
        if phase == 1:
            if me != root:
                if not _reached(words, COPIED, g + 1, root, root + 1, spins):
                    return _stop(state, lo, g, 1, COPIED, g + 1, s, root, root + 1, WAIT)
                if _other_call(words, s, root, root + 1, fingerprint, number):
                    return _stop(state, lo, g, 1, COPIED, g + 1, s, root, root + 1, MISMATCH)
                copy_into(part, slot(data, x, root, s, slots, chunk, m))
            phase = 2
        if lo + m >= n:  # the last chunk: every rank is in this very call
            if not _reached(words, COPIED, g + 1, 0, p, spins):
                return _stop(state, lo, g, 2, COPIED, g + 1, s, 0, p, WAIT)
            if _other_call(words, s, 0, p, fingerprint, number):
                return _stop(state, lo, g, 2, COPIED, g + 1, s, 0, p, MISMATCH)
        lo += m
        g += 1
        phase = 0
        if _advance(words, me, GATHERED, g, p):
            return _stop(state, lo, g, 0, GATHERED, g, s, 0, p, WAKE)
    return _stop(state, lo, g, 0, 0, 0, 0, 0, 0, DONE)


@jit
def all_gather(x, out, data, words, state):  # type: ignore[no-untyped-def]
    """Per chunk: every rank copies its part into its slot and into its own block of
    ``out``, then the other ranks' parts out of their slots."""
    me, p, slots, chunk, spins, _, _, fingerprint, number = _params(state)
    n = x.shape[0]
    per = chunk // x.itemsize
    lo, g, phase = state[LO], state[CHUNK], state[PHASE]
    while lo < n:
        m = min(per, n - lo)
        s = g % slots
        part = x[lo : lo + m]
        if phase == 0:
            if g >= slots and not _reached(words, GATHERED, g - slots + 1, 0, p, spins):
                return _stop(state, lo, g, 0, GATHERED, g - slots + 1, s, 0, p, WAIT)
            _claim(words, me, s, fingerprint, number)
            copy_into(slot(data, x, me, s, slots, chunk, m), part)
            copy_into(out[me * n + lo : me * n + lo + m], part)  # from cache, just read
            phase = 1
            if _advance(words, me, COPIED, g + 1, p):
                return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, WAKE)
        if not _reached(words, COPIED, g + 1, 0, p, spins):
            return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, WAIT)
        if _other_call(words, s, 0, p, fingerprint, number):
            return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, MISMATCH)
        for q in range(p):
            if q != me:
                copy_into(out[q * n + lo : q * n + lo + m], slot(data, x, q, s, slots, chunk, m))
        lo += m
        g += 1
        phase = 0
        if _advance(words, me, GATHERED, g, p):
            return _stop(state, lo, g, 0, GATHERED, g, s, 0, p, WAKE)
    return _stop(state, lo, g, 0, 0, 0, 0, 0, 0, DONE)


@jit
def reduce_scatter(blocks, out, data, words, state, divisor):  # type: ignore[no-untyped-def]
    """Per chunk: a rank copies into its slot its contribution to the other ranks' blocks,
    then folds its own block from ``blocks`` and the peers' slots into ``out``, in rank
    order. ``out`` must not overlap ``blocks``."""
    me, p, slots, chunk, spins, op, _, fingerprint, number = _params(state)
    n = out.shape[0]
    per = chunk // (out.itemsize * p)
    lo, g, phase = state[LO], state[CHUNK], state[PHASE]
    while lo < n:
        m = min(per, n - lo)
        s = g % slots
        if phase == 0:
            if g >= slots and not _reached(words, GATHERED, g - slots + 1, 0, p, spins):
                return _stop(state, lo, g, 0, GATHERED, g - slots + 1, s, 0, p, WAIT)
            _claim(words, me, s, fingerprint, number)
            mine = slot(data, out, me, s, slots, chunk, m * p)
            for q in range(p):  # slot layout: the contribution to rank q at q*m
                if q != me:
                    copy_into(mine[q * m : (q + 1) * m], blocks[q * n + lo : q * n + lo + m])
            phase = 1
            if _advance(words, me, COPIED, g + 1, p):
                return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, WAKE)
        if not _reached(words, COPIED, g + 1, 0, p, spins):
            return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, WAIT)
        if _other_call(words, s, 0, p, fingerprint, number):
            return _stop(state, lo, g, 1, COPIED, g + 1, s, 0, p, MISMATCH)
        own = blocks[me * n + lo : me * n + lo + m]
        target = out[lo : lo + m]
        first = own if me == 0 else slot(data, out, 0, s, slots, chunk, m * p)[me * m : (me + 1) * m]
        second = own if me == 1 else slot(data, out, 1, s, slots, chunk, m * p)[me * m : (me + 1) * m]
        _fold(target, first, second, op, divisor if p == 2 else 1.0)
        for q in range(2, p):
            src = own if q == me else slot(data, out, q, s, slots, chunk, m * p)[me * m : (me + 1) * m]
            _fold_in(target, src, op, divisor if q == p - 1 else 1.0)
        lo += m
        g += 1
        phase = 0
        if _advance(words, me, GATHERED, g, p):
            return _stop(state, lo, g, 0, GATHERED, g, s, 0, p, WAKE)
    return _stop(state, lo, g, 0, 0, 0, 0, 0, 0, DONE)


def new_state() -> np.ndarray:  # type: ignore[type-arg]
    return np.zeros(STATE, np.int64)
