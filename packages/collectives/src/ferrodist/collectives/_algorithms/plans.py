"""Algorithms as data: who talks to whom, at which step, about which chunk.

Each plan is a plain value computed from (message size, group size, rank). The
engines in ``ring``, ``doubling``, ``tree`` and ``direct`` only execute plans,
so tests can check a plan's properties (every chunk reduced once, every send
matched by the receive of the same step) without moving a byte.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = [
    "DoublingPlan",
    "RingPlan",
    "TreePlan",
    "binomial_tree",
    "chunk_layout",
    "dissemination_peers",
    "doubling_plan",
    "ring_plan",
]


def chunk_layout(count: int, parts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split ``count`` elements into ``parts`` contiguous chunks, sizes differing by at most one.

    >>> chunk_layout(10, 4)
    ((3, 3, 2, 2), (0, 3, 6, 8))
    """
    base, extra = divmod(count, parts)
    counts = tuple(base + (1 if i < extra else 0) for i in range(parts))
    offsets = tuple(sum(counts[:i]) for i in range(parts))
    return counts, offsets


@dataclass(frozen=True)
class RingPlan:
    """Ring reduce-scatter then all-gather over ``size`` chunks.

    ``reduce_steps[s] = (send_chunk, recv_chunk)``: at step s this rank sends its partial
    sum of ``send_chunk`` to the right neighbour and receives the left neighbour's partial
    sum of ``recv_chunk``. After the reduce steps this rank owns ``owned`` in full;
    ``gather_steps`` then circulate the finished chunks.
    """

    rank: int
    size: int
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    right: int
    left: int
    reduce_steps: tuple[tuple[int, int], ...]
    gather_steps: tuple[tuple[int, int], ...]
    owned: int

    def span(self, chunk: int) -> slice:
        return slice(self.offsets[chunk], self.offsets[chunk] + self.counts[chunk])


def ring_plan(count: int, size: int, rank: int) -> RingPlan:
    counts, offsets = chunk_layout(count, size)
    reduce_steps = tuple(((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1))
    gather_steps = tuple(((rank + 1 - s) % size, (rank - s) % size) for s in range(size - 1))
    return RingPlan(
        rank=rank,
        size=size,
        counts=counts,
        offsets=offsets,
        right=(rank + 1) % size,
        left=(rank - 1) % size,
        reduce_steps=reduce_steps,
        gather_steps=gather_steps,
        owned=(rank + 1) % size,
    )


@dataclass(frozen=True)
class DoublingPlan:
    """Recursive doubling (recursive halving of distance) for any group size.

    With ``size`` not a power of two, the first ``2*extra`` ranks pair up first: the
    even one of each pair hands its data to the odd one (``fold_to``) and waits for the
    result (``unfold_from``); the odd one receives it (``fold_from``) and sends the
    result back at the end (``unfold_to``). Participating ranks then exchange with
    ``partners[0]``, ``partners[1]``, ... (distance 1, 2, 4, ... among the participants).
    """

    rank: int
    size: int
    fold_to: int | None
    fold_from: int | None
    partners: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def doubling_plan(size: int, rank: int) -> DoublingPlan:
    power = 1 << (size.bit_length() - 1)
    extra = size - power

    def real(virtual: int) -> int:
        return 2 * virtual + 1 if virtual < extra else virtual + extra

    if rank < 2 * extra and rank % 2 == 0:
        return DoublingPlan(rank, size, fold_to=rank + 1, fold_from=None, partners=())
    virtual = rank // 2 if rank < 2 * extra else rank - extra
    fold_from = rank - 1 if rank < 2 * extra else None
    partners = []
    mask = 1
    while mask < power:
        partners.append(real(virtual ^ mask))
        mask <<= 1
    return DoublingPlan(rank, size, fold_to=None, fold_from=fold_from, partners=tuple(partners))


@dataclass(frozen=True)
class TreePlan:
    """This rank's place in a binomial tree rooted at ``root``.

    Data flows from ``parent`` to ``children`` (broadcast, scatter) or back (reduce,
    gather). Children are listed nearest-subtree-last for sending (largest subtree
    first) and the reverse order is used when reducing.
    """

    rank: int
    size: int
    root: int
    parent: int | None
    children: tuple[int, ...]


def binomial_tree(size: int, root: int, rank: int) -> TreePlan:
    relative = (rank - root) % size
    parent = None
    mask = 1
    while mask < size:
        if relative & mask:
            parent = (relative - mask + root) % size
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if relative + mask < size:
            children.append((relative + mask + root) % size)
        mask >>= 1
    return TreePlan(rank, size, root, parent, tuple(children))


def dissemination_peers(size: int, rank: int) -> tuple[tuple[int, int], ...]:
    """Barrier rounds: in round k send to ``rank + 2**k`` and receive from ``rank - 2**k``."""
    rounds = []
    distance = 1
    while distance < size:
        rounds.append(((rank + distance) % size, (rank - distance) % size))
        distance <<= 1
    return tuple(rounds)
