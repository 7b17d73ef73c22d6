"""Recursive doubling all_reduce: log2(p) exchanges of the whole message, for small messages."""

from __future__ import annotations

from ferrodist.collectives._call import Array, Call, Reducer

from .plans import doubling_plan


def all_reduce(call: Call, x: Array, reduce: Reducer, divisor: float) -> None:
    """Reduce ``x`` in place. Both ranks of a pair combine (lower rank's data, higher
    rank's data) in that order, so every rank computes exactly the same bits."""
    plan = doubling_plan(call.size, call.rank)
    if plan.fold_to is not None:  # an extra rank: hand over, then wait for the result
        call.send(x, plan.fold_to)
        call.recv(x, plan.fold_to)
        return
    incoming = call.scratch.get(0, x.shape[0], x.dtype)
    if plan.fold_from is not None:
        call.recv(incoming, plan.fold_from)
        last = not plan.partners
        reduce(x, (incoming, x), divisor if last else 1.0)
    for index, partner in enumerate(plan.partners):
        call.exchange(x, partner, incoming, partner)
        pair = (incoming, x) if partner < call.rank else (x, incoming)
        reduce(x, pair, divisor if index == len(plan.partners) - 1 else 1.0)
    if plan.fold_from is not None:
        call.send(x, plan.fold_from)
