"""The records of a TCP link's messages: a posted receive (``Pending``, ``Recv``), a frame
being read (``Frame``), a message that arrives before its receive is posted (``Arrival``),
and a send (``Done``).

No length read from the wire is reserved before its bytes come: a frame whose receive is
posted is read into that receive's buffer (and one that does not fit it is read and
dropped through a small scratch buffer); a message nobody waits for yet is kept in pieces
allocated as its bytes arrive (``PIECE``, then at most as much again as has come).
"""

from __future__ import annotations

from collections.abc import Callable

from ferrodist.transport._checks import Buffer
from ferrodist.transport._frames import DATA

__all__ = ["DONE", "PIECE", "Arrival", "Done", "Frame", "Pending", "Recv"]

#: The first piece of a message that arrives before its receive (and of a scratch buffer).
PIECE = 1 << 20


class Done:
    """A send: complete when ``isend`` returns (the bytes are in the kernel's hands)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


DONE = Done()


class Pending:
    """A posted receive: from one sender (``src``), or from whichever of ``sources`` sends
    first (then ``src`` is -1 until a message is matched with it)."""

    __slots__ = ("buf", "claimed", "done", "error", "fingerprint", "order", "sources", "src", "tag")

    def __init__(
        self, buf: Buffer, tag: int, fingerprint: int, src: int = -1, sources: tuple[int, ...] | None = None
    ) -> None:
        self.buf = buf
        self.tag = tag
        self.fingerprint = fingerprint
        self.src = src
        self.sources = sources
        self.order = 0  # when it was queued (the mailbox numbers receives and early arrivals)
        self.claimed = False  # the receiver thread is reading into buf
        self.done = False
        self.error: BaseException | None = None

    @property
    def senders(self) -> tuple[int, ...]:
        """The ranks its message may come from."""
        return (self.src,) if self.sources is None else self.sources


class Arrival:
    """A message that arrives before its receive is posted: its header, and its payload in
    pieces as they come (``done`` once whole). A receive posted while it arrives takes it
    (``taker``) and is filled when it is whole; ``dropped``: nobody will take it (its
    channel was aborted, or it did not fit the receive that took it)."""

    __slots__ = ("done", "dropped", "fingerprint", "length", "order", "pieces", "received", "tag", "taker")

    def __init__(self, tag: int, fingerprint: int, length: int, order: int = 0) -> None:
        self.tag = tag
        self.order = order  # when it came (a receive from any of several senders takes the first)
        self.fingerprint = fingerprint
        self.length = length
        self.pieces: list[bytearray] = []
        self.received = 0  # bytes of the pieces allocated so far (each one full before the next)
        self.done = False
        self.dropped = False
        self.taker: Pending | None = None

    def drop(self) -> None:
        self.dropped = True
        self.pieces = []


class Recv:
    """A posted receive. ``wait`` is the wait of whoever matches it (its sender's link, or
    for a receive from any of several senders, the links' ``Context``), for ``timeout``
    seconds unless the caller says otherwise."""

    def __init__(self, pending: Pending, wait: Callable[[Pending, float], None], timeout: float) -> None:
        self._p = pending
        self._wait = wait
        self._timeout = timeout

    def is_completed(self) -> bool:
        return self._p.done

    def wait(self, timeout: float | None = None) -> None:
        self._wait(self._p, self._timeout if timeout is None else timeout)

    @property
    def source(self) -> int | None:
        """The rank the message came from (of a receive from any of several: once it has
        begun to arrive); None before."""
        return None if self._p.src < 0 else self._p.src


class Frame:
    """A frame being read: where its payload goes (a posted receive's buffer; the pieces of
    an ``Arrival``; a scratch buffer, to drop one that nobody will take; a notice's bytes)
    and how much is left to place."""

    __slots__ = ("arrival", "error", "fingerprint", "kind", "left", "payload", "pending", "piece", "tag")

    def __init__(
        self, tag: int, fingerprint: int, pending: Pending | None, error: BaseException | None, kind: int = DATA
    ) -> None:
        self.kind = kind
        self.tag = tag
        self.fingerprint = fingerprint
        self.pending = pending
        self.error = error
        self.arrival: Arrival | None = None
        self.payload: bytearray | None = None  # a notice's bytes, or the scratch of a dropped frame
        self.piece = memoryview(b"")
        self.left = 0

    def next_piece(self) -> None:
        """Where the next bytes go: a new piece of the arrival (at most as large as what has
        come, 1 MiB at first), or the scratch buffer (made once, 1 MiB at most)."""
        arrival = self.arrival
        if arrival is not None and not arrival.dropped:
            piece = bytearray(min(self.left, max(PIECE, arrival.received)))
            arrival.pieces.append(piece)
            arrival.received += len(piece)
            self.piece = memoryview(piece)
        else:
            if self.payload is None:
                self.payload = bytearray(min(self.left, PIECE))
            self.piece = memoryview(self.payload)[: min(self.left, len(self.payload))]
        self.left -= len(self.piece)
