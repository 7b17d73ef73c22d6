"""Point to point on a ``ProcessGroup``: ``send``, ``recv``, ``isend``, ``irecv`` by group rank.

Messages travel on the group's channel with the user's tag (``p2p_tag``), apart from the
group's collectives; device tensors go through the device engine. A receive without a
sender takes the next message with its tag from any other rank of the group (the
transport's ``irecv_any``), and its work says whose it was. A wait is bounded by the
group's timeout (or the caller's); an aborted group fails them at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ferrodist.core import InvalidRank
from ferrodist.transport import Transport

from . import _trace
from ._call import MAX_USER_TAG, p2p_tag
from ._checks import Checker
from ._device import device_type, messages
from ._runner import Runner
from ._timeouts import Timeout
from ._work import RequestWork


class Messages:
    """The point-to-point messages of one group on this rank."""

    def __init__(
        self, transport: Transport, runner: Runner, ranks: Sequence[int], group_id: int, name: str, timeout: float
    ) -> None:
        self._transport = transport
        self._runner = runner
        self._ranks = tuple(ranks)
        self._group_id = group_id
        self._name = name
        self._timeout = timeout

    def start(
        self, operation: str, check: Checker, tensor: Any, peer: int | None, tag: int, timeout: Timeout = None
    ) -> RequestWork:
        """Check and start one message (``send``/``isend`` out, ``recv``/``irecv`` in); its
        wait is bounded by ``timeout`` (or the group's)."""
        return self.prepare(operation, check, tensor, peer, tag, timeout).start()

    def receive(self, check: Checker, tensor: Any, peer: int | None, tag: int, timeout: Timeout = None) -> int:
        """``recv``: a message of ``tensor``'s exact size from group rank ``peer`` or, for None,
        the next message with ``tag`` that any other rank of the group sends; returns the
        sender's group rank once the message is in ``tensor``."""
        work = self.start("recv", check, tensor, peer, tag, timeout)
        work.wait()
        sender = work.source
        assert sender is not None  # a receive that finished knows its sender
        return sender

    def prepare(
        self, operation: str, check: Checker, tensor: Any, peer: int | None, tag: int, timeout: Timeout = None
    ) -> Message:
        """Check one message and make it ready to start (``peer`` None: a receive from any
        other rank of the group)."""
        sending = operation in ("send", "isend")
        me = self._ranks.index(check.rank)
        if peer is None and not sending:
            if len(self._ranks) == 1:
                raise check.fail("a group of one rank has no other rank to receive from", InvalidRank)
            sources = tuple(r for i, r in enumerate(self._ranks) if i != me)
            whom = "any other rank"
        else:
            peer_rank = check.root(peer, len(self._ranks), "dst" if sending else "src")
            if peer_rank == me:
                raise check.fail(f"peer {peer_rank} is this rank itself; copy the data locally", InvalidRank)
            sources, whom = (self._ranks[peer_rank],), f"group rank {peer_rank}"
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_USER_TAG:
            raise check.fail(f"tag must be an integer in 0..{MAX_USER_TAG}, not {tag!r}")
        t = check.tensor(tensor, writeable=not sending)
        on_device = device_type(check.rank, operation, [t]) is not None
        return Message(
            self,
            operation,
            t if on_device else t.flat(),
            sources[0] if peer is not None else None,
            sources,
            tag,
            self._timeout if timeout is None else self._runner.limit(timeout, operation),
            f"rank {check.rank}: {operation} with {whom} (tag {tag}) on group {self._name}",
            on_device,
        )

    def group_rank(self, transport_rank: int | None) -> int | None:
        return None if transport_rank is None else self._ranks.index(transport_rank)

    def _traced(self, operation: str, peer: int | None, tag: int, x: Any) -> Callable[[bool], None] | None:
        """What records a message in this rank's trace when it ends (None: tracing is off)."""
        tracer = self._runner.tracer
        if tracer is None:
            return None
        start, group = _trace.now(), self._name
        args = {"group": group, "peer": peer, "tag": tag, "bytes": int(x.nbytes)}

        def record(failed: bool) -> None:
            tracer.event(operation, "p2p", f"group {group} messages", start, _trace.now(), {**args, "failed": failed})

        return record


@dataclasses.dataclass(frozen=True)
class Message:
    """One checked message, ready to start."""

    messages: Messages
    operation: str
    x: Any  # a flat host array, or a device Tensor
    peer: int | None  # transport rank; None: a receive from any of ``sources``
    sources: tuple[int, ...]  # the transport ranks it may come from (or goes to)
    tag: int  # the user's
    limit: float
    context: str
    on_device: bool

    @property
    def sending(self) -> bool:
        return self.operation in ("send", "isend")

    def start(self) -> RequestWork:
        owner = self.messages
        wire_tag = p2p_tag(owner._group_id, self.tag)
        traced = owner._traced(self.operation, self.peer, self.tag, self.x)
        transport: Any = owner._transport if self.peer is not None else _FromAny(owner._transport, self.sources)
        if self.on_device:  # staged through host memory on every route
            dev = messages(owner._transport.rank, self.operation)
            start = dev.isend if self.sending else dev.irecv
            request = start(transport, self.x, -1 if self.peer is None else self.peer, wire_tag)  # _FromAny: no peer
        else:
            request = (transport.isend if self.sending else transport.irecv)(self.x, self.peer, wire_tag)
        if self.sending:
            return RequestWork(self.context, request, self.limit, self.context, traced)
        sender = owner.group_rank(self.peer)
        source = (lambda: sender) if sender is not None else (lambda: owner.group_rank(transport.source))
        return RequestWork(self.context, request, self.limit, self.context, traced, source)


class _FromAny:
    """A transport whose ``irecv`` receives from whichever of ``sources`` sends first (for
    the device engine's staged receive too); ``source`` is the sender, once known."""

    def __init__(self, transport: Transport, sources: tuple[int, ...]) -> None:
        self._transport = transport
        self._sources = sources
        self._request: Any = None

    def irecv(self, buf: Any, peer: None, tag: int) -> Any:
        self._request = self._transport.irecv_any(buf, self._sources, tag)
        return self._request

    @property
    def source(self) -> int | None:
        return None if self._request is None else self._request.source
