"""Ring algorithms: bandwidth-optimal all_reduce, all_gather and reduce_scatter.

Each rank sends only to its right neighbour and receives only from its left one;
per step, the send and the receive run at the same time. A rank moves
2(p-1)/p of the data for all_reduce, whatever the group size.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrodist.collectives._call import Array, Call, Reducer

from .plans import ring_plan


def all_reduce(call: Call, x: Array, reduce: Reducer, divisor: float) -> None:
    """Reduce ``x`` across the group in place: ring reduce-scatter, then ring all-gather.

    Each chunk's final value is computed by exactly one rank and then copied to the
    others, so every rank ends with the same bits.
    """
    plan = ring_plan(x.shape[0], call.size, call.rank)
    incoming = call.scratch.get(0, max(plan.counts), x.dtype)
    last = len(plan.reduce_steps) - 1
    for step, (send_chunk, recv_chunk) in enumerate(plan.reduce_steps):
        target = x[plan.span(recv_chunk)]
        partial = incoming[: plan.counts[recv_chunk]]
        call.exchange(x[plan.span(send_chunk)], plan.right, partial, plan.left)
        reduce(target, (partial, target), divisor if step == last else 1.0)
    for send_chunk, recv_chunk in plan.gather_steps:
        call.exchange(x[plan.span(send_chunk)], plan.right, x[plan.span(recv_chunk)], plan.left)


def all_gather(call: Call, blocks: Sequence[Array]) -> None:
    """Fill ``blocks[i]`` with rank i's block; ``blocks[call.rank]`` already holds ours."""
    right, left = (call.rank + 1) % call.size, (call.rank - 1) % call.size
    for step in range(call.size - 1):
        send_block = (call.rank - step) % call.size
        recv_block = (call.rank - step - 1) % call.size
        call.exchange(blocks[send_block], right, blocks[recv_block], left)


def reduce_scatter(call: Call, out: Array, blocks: Sequence[Array], reduce: Reducer, divisor: float) -> None:
    """``out`` = reduction over ranks of their ``blocks[call.rank]``; ``blocks`` are not modified."""
    size, rank = call.size, call.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    count = out.shape[0]
    incoming = call.scratch.get(0, count, out.dtype)
    partial = call.scratch.get(1, count, out.dtype)  # our running sum (free again once sent)
    outgoing = blocks[(rank - 1) % size]  # step 0 sends our own contribution, unreduced
    for step in range(size - 1):
        recv_block = (rank - step - 2) % size
        call.exchange(outgoing, right, incoming, left)
        last = step == size - 2
        target = out if last else partial
        reduce(target, (incoming, blocks[recv_block]), divisor if last else 1.0)
        outgoing = target
