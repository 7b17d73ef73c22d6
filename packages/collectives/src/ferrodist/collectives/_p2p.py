"""Point to point on a ``ProcessGroup``: ``send``, ``recv``, ``isend``, ``irecv`` by group rank.

Messages travel on the group's channel with the user's tag (``p2p_tag``), apart from the
group's collectives; device tensors go through the device engine. A wait is bounded by
the group's timeout (or the caller's); an aborted group fails them at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ferrodist.core import CollectiveTimeout, FerrodistError, GroupAborted, InvalidRank
from ferrodist.transport import DeviceMessages, Transport

from . import _failure, _trace
from ._call import MAX_USER_TAG, p2p_tag
from ._checks import Checker
from ._device import device_type, messages
from ._runner import Runner
from ._timeouts import Timeout
from ._work import RequestWork, Work


class PointToPoint:
    """The point-to-point methods of ``ProcessGroup`` (a mixin over the group's checks,
    route and runner, declared here)."""

    _transport: Transport
    _runner: Runner
    _ranks: tuple[int, ...]
    _rank: int | None
    _global_rank: int
    _group_id: int
    _name: str
    _timeout: float

    def _checker(self, operation: str) -> Checker:
        raise NotImplementedError

    def _p2p(
        self, operation: str, tensor: Any, peer: int, tag: int, *, writeable: bool
    ) -> tuple[Any, int, int, str, Any]:
        check = self._checker(operation)
        peer_rank = check.root(peer, len(self._ranks), "dst" if operation in ("send", "isend") else "src")
        if peer_rank == self._rank:
            raise check.fail(f"peer {peer_rank} is this rank itself; copy the data locally", InvalidRank)
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_USER_TAG:
            raise check.fail(f"tag must be an integer in 0..{MAX_USER_TAG}, not {tag!r}")
        t = check.tensor(tensor, writeable=writeable)
        context = f"rank {self._global_rank}: {operation} with group rank {peer_rank} (tag {tag}) on group {self._name}"
        # Device tensors are staged through host memory on every route (see _device).
        dev = messages(self._global_rank, operation) if device_type(self._global_rank, operation, [t]) else None
        return (t if dev else t.flat()), self._ranks[peer_rank], p2p_tag(self._group_id, tag), context, dev

    def _start(self, x: Any, peer: int, tag: int, dev: DeviceMessages | None, *, sending: bool) -> Any:
        if dev is not None:
            return (dev.isend if sending else dev.irecv)(self._transport, x, peer, tag)
        return (self._transport.isend if sending else self._transport.irecv)(x, peer, tag)

    def _traced(self, operation: str, peer: int, tag: int, x: Any) -> Callable[[bool], None] | None:
        """What records a message in this rank's trace when it ends (None: tracing is off)."""
        tracer = self._runner.tracer
        if tracer is None:
            return None
        start, group = _trace.now(), self._name
        args = {"group": group, "peer": peer, "tag": tag, "bytes": int(x.nbytes)}

        def record(failed: bool) -> None:
            tracer.event(operation, "p2p", f"group {group} messages", start, _trace.now(), {**args, "failed": failed})

        return record

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to group rank ``dst``; don't modify it until ``wait()`` returns."""
        x, peer, wire_tag, context, dev = self._p2p("isend", tensor, dst, tag, writeable=False)
        traced = self._traced("isend", peer, tag, x)
        request = self._start(x, peer, wire_tag, dev, sending=True)
        return RequestWork(context, request, self._timeout, context, traced)

    def irecv(self, tensor: Any, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from group rank ``src``; read it after ``wait()``."""
        x, peer, wire_tag, context, dev = self._p2p("irecv", tensor, src, tag, writeable=True)
        traced = self._traced("irecv", peer, tag, x)
        request = self._start(x, peer, wire_tag, dev, sending=False)
        return RequestWork(context, request, self._timeout, context, traced)

    def send(self, tensor: Any, dst: int, tag: int = 0, *, timeout: Timeout = None) -> None:
        """Send ``tensor`` to group rank ``dst`` (matched by a ``recv`` there with the same tag)."""
        x, peer, wire_tag, context, dev = self._p2p("send", tensor, dst, tag, writeable=False)
        traced = self._traced("send", peer, tag, x)
        request = self._start(x, peer, wire_tag, dev, sending=True)
        RequestWork(context, request, self._runner.limit(timeout, "send"), context, traced).wait()

    def abort(self, error: BaseException) -> None:
        """Fail this group on every member because of ``error`` (raised by code that drives
        the group, e.g. a pipeline stage): pending and later calls and messages here and on
        the other members raise at once (``GroupAborted``, or the error itself where a
        message was pending) instead of waiting for their deadline. Make the group again to
        go on. An error that is already a ``GroupAborted`` is not sent again.

        A timeout of this rank waiting for one peer's message follows the other ranks'
        notices (for up to half a second) to the rank that held them all up, and names it in
        ``error`` (its message and ``waiting_for``): the peer waited for may be waiting
        itself, as stages of a pipeline wait on each other."""
        if isinstance(error, GroupAborted):
            return
        if not isinstance(error, FerrodistError):
            error = FerrodistError(f"rank {self._global_rank}: {type(error).__name__}: {error}", rank=self._global_rank)
        self._runner.abort(error)
        if isinstance(error, CollectiveTimeout):
            _failure.name_the_holdup(self._transport, self._group_id, self._global_rank, error)

    def sole_peer(self, operation: str) -> int:
        """The group rank a receive from any source can come from: the other rank of a
        group of two. Larger groups raise: a transport matches a message by (sender, tag),
        so "whichever sender comes first" cannot be asked of it without taking a message
        that a later receive is waiting for."""
        check = self._checker(operation)
        if len(self._ranks) == 2:
            return 1 - self._ranks.index(self._global_rank)
        raise check.fail(
            f"src=None (any source) works in a group of two ranks only; this group has {len(self._ranks)}. "
            "ferrodist's transports match a message by its sender and tag, so waiting for whichever rank sends "
            "first could take a message that a later receive is waiting for: pass src= (the sender's rank)"
        )

    def recv(self, tensor: Any, src: int, tag: int = 0, *, timeout: Timeout = None) -> None:
        """Receive into ``tensor`` from group rank ``src`` (the message must have its exact size)."""
        x, peer, wire_tag, context, dev = self._p2p("recv", tensor, src, tag, writeable=True)
        traced = self._traced("recv", peer, tag, x)
        request = self._start(x, peer, wire_tag, dev, sending=False)
        RequestWork(context, request, self._runner.limit(timeout, "recv"), context, traced).wait()
