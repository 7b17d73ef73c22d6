"""Binomial-tree broadcast and reduce (log2(p) rounds), and the dissemination barrier."""

from __future__ import annotations

import numpy as np

from ferrodist.collectives._call import Array, Call, Reducer

from .plans import binomial_tree, dissemination_peers


def broadcast(call: Call, x: Array, root: int) -> None:
    call.agree()  # a root that sends and returns would not notice a peer naming another root
    plan = binomial_tree(call.size, root, call.rank)
    if plan.parent is not None:
        call.recv(x, plan.parent)
    call.wait_all([call.isend(x, child) for child in plan.children])


def reduce(call: Call, x: Array, root: int, reduce: Reducer, divisor: float) -> None:
    """Reduce into the root's ``x``; other ranks' ``x`` is left as it was."""
    call.agree()  # ranks naming different roots would each wait for the other
    plan = binomial_tree(call.size, root, call.rank)
    incoming = call.scratch.get(0, x.shape[0], x.dtype)
    acc = x if plan.parent is None else call.scratch.get(1, x.shape[0], x.dtype)
    current = x  # what we hold so far; becomes ``acc`` once something is combined
    children = plan.children[::-1]  # smallest subtree first: it finishes first
    for index, child in enumerate(children):
        call.recv(incoming, child)
        last = plan.parent is None and index == len(children) - 1
        reduce(acc, (current, incoming), divisor if last else 1.0)
        current = acc
    if plan.parent is not None:
        call.send(current, plan.parent)


_TOKEN = np.zeros(1, np.uint8)


def barrier(call: Call) -> None:
    token_in = call.scratch.get(0, 1, np.dtype(np.uint8))
    for to, frm in dissemination_peers(call.size, call.rank):
        call.exchange(_TOKEN, to, token_in, frm)
