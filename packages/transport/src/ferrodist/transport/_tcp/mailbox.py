"""How a TCP transport's messages meet their receives. Each link has a ``Mailbox``: the
receives posted for its peer's messages and the messages that arrived before theirs,
matched by tag in the order each side came. ``Mailboxes`` holds every link's mailbox and
the receives from any of several senders, which compete across the links, and numbers
receives and kept messages in the order they come.

Every method runs under the links' condition (``Context.cond``), which their readers and
their waiting callers share; the caller wakes the waiters.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from ferrodist.transport._checks import check_match

from .records import Arrival, Pending

__all__ = ["Mailbox", "Mailboxes"]


class Mailboxes:
    """The mailboxes of one transport's links (``of``, by peer) and its receives from any of
    several senders (``anywhere``, by tag, in the order they were posted).

    A receive from any of several senders (``post_any``) competes with the receives that
    name one sender: a message goes to whichever of those posted first that can take it,
    and such a receive posted after messages came takes the one that came first.
    """

    def __init__(self) -> None:
        self.of: dict[int, Mailbox] = {}
        self.anywhere: dict[int, list[Pending]] = {}
        self._order = 0  # receives queued and messages kept, numbered as they come

    def next(self) -> int:
        self._order += 1
        return self._order

    def waiting_for(self, src: int, tag: int) -> Pending | None:
        """The first receive from any of several senders that would take ``src``'s message."""
        return next((p for p in self.anywhere.get(tag, ()) if src in p.sources), None)  # type: ignore[operator]

    def unqueue(self, pending: Pending) -> None:
        """Take a receive from any of several senders off its queue (a message is its now)."""
        waiting = self.anywhere[pending.tag]
        waiting.remove(pending)
        if not waiting:
            del self.anywhere[pending.tag]

    def post_any(self, pending: Pending) -> None:
        """A receive from whichever of ``pending.sources`` sends first: matched with the
        message from one of them that came first, else queued."""
        tag, first, order = pending.tag, -1, 0
        for src in pending.sources or ():
            kept = self.of[src].first_kept(tag)
            if kept and (first < 0 or kept < order):
                first, order = src, kept
        if first >= 0:
            pending.src = first
            self.of[first].take(pending)
        else:
            pending.order = self.next()
            self.anywhere.setdefault(tag, []).append(pending)

    def withdraw(self, pending: Pending) -> None:
        """Take back a receive nothing has claimed (its wait failed)."""
        if pending.sources is not None:
            if pending in self.anywhere.get(pending.tag, ()):
                self.unqueue(pending)
            return
        self.of[pending.src].withdraw(pending)

    def clear(self, dropped: Callable[[int], bool]) -> list[Pending]:
        """Forget the early arrivals whose tag is ``dropped`` (read to their end, then
        forgotten) and take back those tags' posted receives, for the caller to fail."""
        taken: list[Pending] = []
        for mailbox in self.of.values():
            taken.extend(mailbox.clear(dropped))
        for tag in [tag for tag in self.anywhere if dropped(tag)]:
            taken.extend(self.anywhere.pop(tag))
        return taken


class Mailbox:
    """One link's posted receives and the messages its peer sent before their receives."""

    def __init__(self, rank: int, peer: int, mailboxes: Mailboxes) -> None:
        self.rank = rank
        self.peer = peer
        self.mailboxes = mailboxes
        self._posted: dict[int, collections.deque[Pending]] = collections.defaultdict(collections.deque)
        self._early: dict[int, collections.deque[Arrival]] = collections.defaultdict(collections.deque)
        mailboxes.of[peer] = self

    def arriving(self, tag: int, fingerprint: int, length: int) -> tuple[Pending | None, Arrival | None]:
        """A message's header has come: the posted receive that takes it (now claimed), or
        the record it is kept in until its receive is posted."""
        queue = self._posted.get(tag)
        pending = queue[0] if queue else None
        mailboxes = self.mailboxes
        rival = mailboxes.waiting_for(self.peer, tag) if mailboxes.anywhere else None
        if rival is not None and (pending is None or rival.order < pending.order):
            mailboxes.unqueue(rival)
            rival.src, pending = self.peer, rival
        elif pending is not None:
            queue.popleft()  # type: ignore[union-attr]
            if not queue:
                del self._posted[tag]
        if pending is not None:
            pending.claimed = True
            return pending, None
        arrival = Arrival(tag, fingerprint, length, mailboxes.next())  # pieces are allocated as its bytes come
        self._early[tag].append(arrival)
        return None, arrival

    def quiet(self, tag: int) -> bool:
        """No receive of ``tag`` from this peer is posted and no such message kept: the next
        one to arrive is the next receive's."""
        return (
            not self._posted.get(tag)
            and not self._early.get(tag)
            and not (self.mailboxes.anywhere and self.mailboxes.waiting_for(self.peer, tag))
        )

    def first_kept(self, tag: int) -> int:
        """When the first message of ``tag`` kept here came (``Mailboxes.next``), or 0: none."""
        kept = self._early.get(tag)
        return kept[0].order if kept else 0

    def post(self, pending: Pending) -> None:
        """A receive of this peer's message: matched with the first one that came before it
        (whole, or still arriving: its header says at once whether it fits), else queued."""
        if self._early.get(pending.tag):
            self.take(pending)
        else:
            pending.order = self.mailboxes.next()
            self._posted[pending.tag].append(pending)

    def take(self, pending: Pending) -> None:
        """Match ``pending`` with the first message of its tag kept here."""
        arrived = self._early[pending.tag]
        arrival = arrived.popleft()
        if not arrived:
            del self._early[pending.tag]
        if arrival.done:
            self.fill(pending, arrival)
            return
        pending.error = check_match(
            self.rank,
            self.peer,
            pending.tag,
            pending.buf.nbytes,
            pending.fingerprint,
            arrival.length,
            arrival.fingerprint,
        )
        if pending.error is None:
            arrival.taker, pending.claimed = pending, True
        else:
            arrival.drop()  # read to its end through a scratch buffer, then forgotten
            pending.done = True

    def fill(self, pending: Pending, arrival: Arrival) -> None:
        """Finish ``pending`` with the whole message ``arrival`` (or with why it does not fit)."""
        pending.error = check_match(
            self.rank,
            self.peer,
            pending.tag,
            pending.buf.nbytes,
            pending.fingerprint,
            arrival.length,
            arrival.fingerprint,
        )
        if pending.error is None:
            offset = 0
            for piece in arrival.pieces:
                pending.buf[offset : offset + len(piece)] = np.frombuffer(piece, np.uint8)
                offset += len(piece)
        arrival.pieces = []
        pending.done = True

    def withdraw(self, pending: Pending) -> None:
        """Take back a receive nothing has claimed (its wait failed)."""
        queue = self._posted.get(pending.tag)
        if queue is not None and pending in queue:
            queue.remove(pending)

    def clear(self, dropped: Callable[[int], bool]) -> list[Pending]:
        """``Mailboxes.clear`` for this peer's messages and receives."""
        for tag in [tag for tag in self._early if dropped(tag)]:
            for arrival in self._early.pop(tag):
                arrival.drop()
        taken: list[Pending] = []
        for tag in [tag for tag in self._posted if dropped(tag)]:
            taken.extend(self._posted.pop(tag))
        return taken
