"""The shared-memory collectives step by step in Python: the protocol of ``loops``.

gather, scatter, barrier and float16/bfloat16 reduce_scatter always run here. The others
run here while their compiled loop (``loops``) for a call's dtype is still compiling in
the background (see ``ferrodist.core.kernels.background``): a call never waits for a
compiler. Each function keeps the protocol of its compiled twin to the word:
the same chunks and slots, the same blocks of a chunk per rank, the same counters
published in the same order, the same checks of the peers' calls. So a rank that runs
one and a rank that runs the other meet in the same call and get the same bits: the
reduction is core's ``reducer`` (compiled, or numpy with the same results), folding the
ranks' blocks in rank order as the compiled loops do.

Every wait is ``Arena.wait``, bounded by the call's deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ferrodist.core import DType, ReduceOp, reducer
from ferrodist.core.kernels import MAX_FUSED_SOURCES, fold_numpy, plan

from .arena import COPIED, GATHERED, REDUCED, Arena

__all__ = [
    "all_gather",
    "all_reduce",
    "all_reduce_in_place",
    "all_reduce_slot",
    "broadcast",
    "chunk",
    "everyone",
    "fold_for",
    "gather",
    "reduce_scatter",
    "scatter",
    "split",
    "sync",
]

Array = np.ndarray[Any, Any]
Health = Callable[[], None]
Fold = Callable[[Array, list[Array], float], None]


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive (start, stop) ranges covering ``count`` (sizes differ by at
    most 1; ``slots.bounds``)."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def fold_for(dt: DType, op: ReduceOp, ranks: int) -> Fold:
    """How these steps fold ``ranks`` ranks' data in rank order with the compiled loops'
    bits: core's ``reducer``, except for float16/bfloat16 from more ranks than one kernel
    reads (``reducer`` would round each group of them; the loops accumulate every rank in
    float32 and round once, as ``fold_numpy`` over all of them does)."""
    kind, _, opcode = plan(dt, op)
    if not kind or ranks <= MAX_FUSED_SOURCES:
        return reducer(dt, op)
    bits = np.dtype(np.uint16)

    def fold(dst: Array, srcs: list[Array], divisor: float) -> None:
        fold_numpy(kind, opcode, divisor != 1.0, dst.view(bits), [s.view(bits) for s in srcs], divisor)

    return fold


def chunk(a: Arena, health: Health, deadline: float, fingerprint: int, seq: int) -> tuple[int, int]:
    """Start the next chunk: wait until its slot is free everywhere, say which call it
    belongs to; returns (chunk number, slot)."""
    g = a.chunks
    a.chunks += 1
    slot = g % a.slots
    if g >= a.slots:
        a.wait(GATHERED, g - a.slots + 1, deadline, health)
    a.publish_call(slot, fingerprint, seq)
    return g, slot


def everyone(a: Arena, health: Health, g: int, s: int, deadline: float, fingerprint: int, seq: int) -> None:
    """Wait until every rank is at chunk ``g`` and check that all are in this very call
    (before this rank lets the slot go: the identities there are the peers' for ``g``)."""
    a.wait(COPIED, g + 1, deadline, health)
    a.check_call(range(a.world), s, fingerprint, seq)


def sync(a: Arena, health: Health, deadline: float, fingerprint: int, seq: int) -> None:
    """A chunk without data: every rank shows up and every rank checks every call."""
    g, s = chunk(a, health, deadline, fingerprint, seq)
    a.advance(COPIED, g + 1)
    everyone(a, health, g, s, deadline, fingerprint, seq)
    a.advance(GATHERED, g + 1)


def all_reduce_slot(
    a: Arena,
    health: Health,
    x: Array,
    views: list[list[Array]],
    fold: Fold,
    divisor: float,
    deadline: float,
    fingerprint: int,
    seq: int,
) -> None:
    """``loops.all_reduce_small``: every rank copies ``x`` into its slot and, after one
    wait, folds every rank's slot into ``x`` in rank order. ``views[s][q]`` is rank q's
    slot s viewed as ``x``."""
    g, s = chunk(a, health, deadline, fingerprint, seq)
    slots = views[s]
    slots[a.rank][...] = x
    a.advance(COPIED, g + 1)
    everyone(a, health, g, s, deadline, fingerprint, seq)
    fold(x, slots, divisor)  # every rank reduces the same sources in the same order
    a.advance(GATHERED, g + 1)


def all_reduce(
    a: Arena,
    health: Health,
    x: Array,
    fold: Fold,
    divisor: float,
    root: int | None,
    deadline: float,
    fingerprint: int,
    seq: int,
) -> None:
    """``loops.all_reduce``: per chunk, this rank copies into its slot the blocks the
    others reduce, folds its own block from ``x`` and the peers' slots into its slot (rank
    order), copies it back into ``x``, and (all_reduce, or the root of a reduce) copies the
    other blocks from their owners' slots. ``x`` is flat, of at least one element."""
    p, me, dtype = a.world, a.rank, x.dtype
    n, per = x.shape[0], a.chunk // x.itemsize
    gather = root is None or root == me
    for lo in range(0, n, per):
        m = min(per, n - lo)
        part = x[lo : lo + m]
        bounds = split(m, p)
        g, s = chunk(a, health, deadline, fingerprint, seq)
        slots = [a.slot(q, s, dtype, m) for q in range(p)]
        for q, (c0, c1) in enumerate(bounds):
            if q != me:
                slots[me][c0:c1] = part[c0:c1]
        a.advance(COPIED, g + 1)
        a.wait(COPIED, g + 1, deadline, health)
        a.check_call(range(p), s, fingerprint, seq)
        b0, b1 = bounds[me]
        out = slots[me][b0:b1]
        fold(out, [part[b0:b1] if q == me else slots[q][b0:b1] for q in range(p)], divisor)
        if gather:
            part[b0:b1] = out
        a.advance(REDUCED, g + 1)
        if gather:
            a.wait(REDUCED, g + 1, deadline, health)
            for q, (c0, c1) in enumerate(bounds):
                if q != me:
                    part[c0:c1] = slots[q][c0:c1]
        a.advance(GATHERED, g + 1)


def all_reduce_in_place(
    a: Arena,
    health: Health,
    x: Array,
    peers: list[Array],
    place: int,
    where: str,
    fold: Fold,
    divisor: float,
    deadline: float,
    fingerprint: int,
    seq: int,
) -> None:
    """all_reduce of ``x``, which lies in shared memory where every peer's ``x`` is
    ``peers[q]`` (``peers[me]`` is ``x``'s memory; ``place`` says where, ``where`` in
    words, and every rank checks that all are at the same place): no slot. Once every
    rank is in the call (so every rank's ``x`` is written), each rank folds its block of
    every rank's ``x`` in rank order into its own ``x``; once every block is reduced, each
    copies the other blocks from their owners; and it returns only once no rank reads its
    ``x`` any more, so the caller may write it again."""
    p, me = a.world, a.rank
    bounds = split(x.shape[0], p)
    g, s = chunk(a, health, deadline, fingerprint, seq)
    a.publish_place(s, place)
    a.advance(COPIED, g + 1)
    everyone(a, health, g, s, deadline, fingerprint, seq)
    a.check_place(s, place, where)
    a.advance(GATHERED, g + 1)
    b0, b1 = bounds[me]
    mine = x[b0:b1]
    fold(mine, [mine if q == me else peers[q][b0:b1] for q in range(p)], divisor)
    sync(a, health, deadline, fingerprint, seq)
    for q, (c0, c1) in enumerate(bounds):
        if q != me:
            x[c0:c1] = peers[q][c0:c1]
    sync(a, health, deadline, fingerprint, seq)


def broadcast(a: Arena, health: Health, x: Array, root: int, deadline: float, fingerprint: int, seq: int) -> None:
    """``loops.broadcast`` over the bytes ``x`` (at least one): per chunk the root copies
    it into its slot, the others copy it out; on the last chunk every rank checks every
    rank's call."""
    p, me = a.world, a.rank
    n, per = x.shape[0], a.chunk
    for lo in range(0, n, per):
        m = min(per, n - lo)
        part = x[lo : lo + m]
        g, s = chunk(a, health, deadline, fingerprint, seq)
        if me == root:
            a.slot(me, s, x.dtype, m)[...] = part
        a.advance(COPIED, g + 1)  # the root: the chunk is there; the others: arrived
        if me != root:
            a.wait(COPIED, g + 1, deadline, health, [root])
            a.check_call([root], s, fingerprint, seq)
            part[...] = a.slot(root, s, x.dtype, m)
        if lo + m >= n:
            a.wait(COPIED, g + 1, deadline, health)
            a.check_call(range(p), s, fingerprint, seq)
        a.advance(GATHERED, g + 1)


def all_gather(a: Arena, health: Health, x: Array, out: Array, deadline: float, fingerprint: int, seq: int) -> None:
    """``loops.all_gather`` over the bytes ``x`` (at least one) and ``out`` (rank-major):
    per chunk each rank copies its part into its slot and its block of ``out``, then the
    others' parts out of their slots."""
    p, me = a.world, a.rank
    n, per = x.shape[0], a.chunk
    for lo in range(0, n, per):
        m = min(per, n - lo)
        part = x[lo : lo + m]
        g, s = chunk(a, health, deadline, fingerprint, seq)
        a.slot(me, s, x.dtype, m)[...] = part
        out[me * n + lo : me * n + lo + m] = part
        a.advance(COPIED, g + 1)
        a.wait(COPIED, g + 1, deadline, health)
        a.check_call(range(p), s, fingerprint, seq)
        for q in range(p):
            if q != me:
                out[q * n + lo : q * n + lo + m] = a.slot(q, s, x.dtype, m)
        a.advance(GATHERED, g + 1)


def reduce_scatter(
    a: Arena,
    health: Health,
    blocks: Array,
    out: Array,
    fold: Fold,
    divisor: float,
    per: int,
    deadline: float,
    fingerprint: int,
    seq: int,
) -> None:
    """``loops.reduce_scatter``: per chunk of ``per`` elements of each block, a rank copies
    into its slot its contribution to the other ranks' blocks (rank q's at q*m), then folds
    its own block from ``blocks`` and the peers' slots into ``out``, in rank order."""
    p, me, dtype = a.world, a.rank, blocks.dtype
    n = out.shape[0]
    for lo in range(0, n, per):
        m = min(per, n - lo)
        g, s = chunk(a, health, deadline, fingerprint, seq)
        mine = a.slot(me, s, dtype, m * p)
        for q in range(p):
            if q != me:
                mine[q * m : (q + 1) * m] = blocks[q * n + lo : q * n + lo + m]
        a.advance(COPIED, g + 1)
        everyone(a, health, g, s, deadline, fingerprint, seq)
        own = blocks[me * n + lo : me * n + lo + m]
        parts = [own if q == me else a.slot(q, s, dtype, m * p)[me * m : (me + 1) * m] for q in range(p)]
        fold(out[lo : lo + m], parts, divisor)
        a.advance(GATHERED, g + 1)


def gather(
    a: Arena,
    health: Health,
    x: Array,
    out: Array | None,
    root: int,
    per: int,
    deadline: float,
    fingerprint: int,
    seq: int,
) -> None:
    """Per chunk: every rank copies its part into its slot; the root copies all out (into
    ``out``, rank-major). On the last chunk every rank checks every rank's call."""
    p, me, dtype = a.world, a.rank, x.dtype
    n = x.shape[0]
    for lo in range(0, n, per):
        m = min(per, n - lo)
        g, s = chunk(a, health, deadline, fingerprint, seq)
        a.slot(me, s, dtype, m)[...] = x[lo : lo + m]
        a.advance(COPIED, g + 1)
        if me == root or lo + m >= n:
            everyone(a, health, g, s, deadline, fingerprint, seq)
        if me == root and out is not None:
            for q in range(p):
                out[q * n + lo : q * n + lo + m] = a.slot(q, s, dtype, m)
        a.advance(GATHERED, g + 1)


def scatter(
    a: Arena,
    health: Health,
    blocks: Array | None,
    x: Array,
    root: int,
    per: int,
    deadline: float,
    fingerprint: int,
    seq: int,
) -> None:
    """Per chunk: the root copies every rank's part of ``blocks`` into its slot, each rank
    copies its own out. On the last chunk every rank checks every rank's call."""
    p, me, dtype = a.world, a.rank, x.dtype
    n = x.shape[0]
    for lo in range(0, n, per):
        m = min(per, n - lo)
        g, s = chunk(a, health, deadline, fingerprint, seq)
        source = a.slot(root, s, dtype, m * p)
        if me == root and blocks is not None:
            for q in range(p):
                source[q * m : (q + 1) * m] = blocks[q * n + lo : q * n + lo + m]
        a.advance(COPIED, g + 1)  # the root: the chunk is there; the others: arrived
        if me != root:
            a.wait(COPIED, g + 1, deadline, health, [root])
            a.check_call([root], s, fingerprint, seq)
        if lo + m >= n:
            everyone(a, health, g, s, deadline, fingerprint, seq)
        x[lo : lo + m] = source[me * m : (me + 1) * m]
        a.advance(GATHERED, g + 1)
