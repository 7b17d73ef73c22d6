"""``P2POp`` and ``batch_isend_irecv``: several sends and receives started together.

Every operation of a batch is checked before any is started; then all receives are
posted, then all sends, and only then does the caller wait (on the returned ``Work``
list). So the order of the list does not matter: ``[recv from 1, send to 1]`` on two
ranks cannot deadlock. Messages are matched as for ``isend``/``irecv``: by peer and tag,
in the order each rank posts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ferrodist.collectives._checks import on_group
from ferrodist.collectives._group import ProcessGroup
from ferrodist.collectives._work import Work
from ferrodist.core import InvalidArgument

from .calls import irecv, isend, peer_rank
from .default_group import resolve


class P2POp:
    """One operation of a ``batch_isend_irecv``: ``op`` (the function ``isend`` or
    ``irecv``), its ``tensor``, and its ``peer`` (a global rank; or ``group_peer``, a rank
    of ``group``), on ``group`` (default: the default group) with ``tag``.

    Example::

        ops = [P2POp(isend, mine, peer=(rank + 1) % size), P2POp(irecv, theirs, peer=(rank - 1) % size)]
        for work in batch_isend_irecv(ops):
            work.wait()
    """

    def __init__(
        self,
        op: Callable[..., Work],
        tensor: Any,
        peer: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        g = resolve(group)
        if op is not isend and op is not irecv:
            raise InvalidArgument(
                f"rank {g.global_rank}: P2POp: op must be ferrodist.collectives.isend or irecv (the functions), "
                f"not {op!r}",
                rank=g.global_rank,
                operation="P2POp",
            )
        name = "isend" if op is isend else "irecv"
        local = peer_rank(g, name, peer, group_peer, "peer")
        check = on_group(g, "P2POp")
        if local is None:
            raise check.fail("name the peer with peer= (a global rank) or group_peer= (a rank of the group)")
        self.op = op
        self.tensor = tensor
        self.group = g
        self.group_peer = check.root(local, g.size, "group_peer")
        self.peer = g.ranks[self.group_peer]
        self.tag = tag

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag}, group={self.group.name})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Start every send and receive of ``p2p_op_list`` (``P2POp`` on one group) and return
    their ``Work``, in the list's order. Nothing starts unless every operation is valid.

    Example (every rank passes its block on round a ring)::

        right, left = (rank + 1) % size, (rank - 1) % size
        got = np.empty(4)
        works = batch_isend_irecv([P2POp(irecv, got, left), P2POp(isend, block, right)])
        for work in works:
            work.wait()                    # got == the left neighbour's block
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise InvalidArgument(f"batch_isend_irecv: expected a non-empty list of P2POp, not {p2p_op_list!r}")
    bad = [i for i, item in enumerate(p2p_op_list) if not isinstance(item, P2POp)]
    if bad:
        raise InvalidArgument(
            f"batch_isend_irecv: entries {bad} are not P2POp (the first is {type(p2p_op_list[bad[0]]).__name__})"
        )
    g = p2p_op_list[0].group
    others = [i for i, item in enumerate(p2p_op_list) if item.group is not g]
    if others:
        raise InvalidArgument(
            f"rank {g.global_rank}: batch_isend_irecv: every P2POp must be on one group; entry 0 is on "
            f"{g.name}, entries {others} are not",
            rank=g.global_rank,
            operation="batch_isend_irecv",
        )
    prepared = []
    for item in p2p_op_list:  # every check first: an error starts nothing
        name = "isend" if item.op is isend else "irecv"
        prepared.append(g._messages.prepare(name, on_group(g, name), item.tensor, item.group_peer, item.tag))
    works: list[Work | None] = [None] * len(prepared)
    for phase in (False, True):  # receives first: incoming bytes land in place, not in a holding buffer
        for i, message in enumerate(prepared):
            if message.sending is phase:
                works[i] = message.start()
    return [w for w in works if w is not None]
