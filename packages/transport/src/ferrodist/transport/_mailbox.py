"""The receives a TCP transport has posted and the messages that arrived before theirs,
matched by (sender, tag) in the order each side came.

Every method runs under the transport's condition (``cond``), which its receiver threads
and its waiting callers share; the transport wakes the waiters.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import numpy as np

from ._matching import check_match
from ._records import Arrival, Pending


class Mailbox:
    """One transport's posted receives and early arrivals."""

    def __init__(self, rank: int, cond: threading.Condition) -> None:
        self.rank = rank
        self.cond = cond
        self._posted: dict[tuple[int, int], collections.deque[Pending]] = collections.defaultdict(collections.deque)
        self._early: dict[tuple[int, int], collections.deque[Arrival]] = collections.defaultdict(collections.deque)

    def arriving(self, src: int, tag: int, fingerprint: int, length: int) -> tuple[Pending | None, Arrival | None]:
        """A message's header has come from ``src``: the posted receive that takes it (now
        claimed), or the record it is kept in until its receive is posted."""
        key = (src, tag)
        queue = self._posted.get(key)
        pending = queue.popleft() if queue else None
        if queue is not None and not queue:
            del self._posted[key]
        if pending is not None:
            pending.claimed = True
            return pending, None
        arrival = Arrival(tag, fingerprint, length)  # pieces are allocated as its bytes come
        self._early[key].append(arrival)
        return None, arrival

    def quiet(self, src: int, tag: int) -> bool:
        """No receive from ``src`` with ``tag`` is posted and no such message kept: the next
        one to arrive is the next receive's."""
        return not self._posted.get((src, tag)) and not self._early.get((src, tag))

    def post(self, pending: Pending, src: int) -> None:
        """A receive from ``src``: matched with the first message that came before it (whole,
        or still arriving: its header says at once whether it fits), else queued."""
        key = (src, pending.tag)
        arrived = self._early.get(key)
        if not arrived:
            self._posted[key].append(pending)
            return
        arrival = arrived.popleft()
        if not arrived:
            del self._early[key]
        if arrival.done:
            self.fill(pending, src, arrival)
            return
        pending.error = check_match(
            self.rank, src, pending.tag, pending.buf.nbytes, pending.fingerprint, arrival.length, arrival.fingerprint
        )
        if pending.error is None:
            arrival.taker, pending.claimed = pending, True
        else:
            arrival.drop()  # read to its end through a scratch buffer, then forgotten
            pending.done = True

    def fill(self, pending: Pending, src: int, arrival: Arrival) -> None:
        """Finish ``pending`` with the whole message ``arrival`` (or with why it does not fit)."""
        pending.error = check_match(
            self.rank, src, pending.tag, pending.buf.nbytes, pending.fingerprint, arrival.length, arrival.fingerprint
        )
        if pending.error is None:
            offset = 0
            for piece in arrival.pieces:
                pending.buf[offset : offset + len(piece)] = np.frombuffer(piece, np.uint8)
                offset += len(piece)
        arrival.pieces = []
        pending.done = True

    def withdraw(self, pending: Pending, src: int) -> None:
        """Take back a receive nothing has claimed (its wait failed)."""
        queue = self._posted.get((src, pending.tag))
        if queue is not None and pending in queue:
            queue.remove(pending)

    def clear(self, dropped: Callable[[int], bool]) -> list[tuple[int, Pending]]:
        """Forget the early arrivals whose tag is ``dropped`` (read to their end, then
        forgotten) and take back those tags' posted receives: ``(sender, receive)`` each,
        for the caller to fail."""
        for key in [key for key in self._early if dropped(key[1])]:
            for arrival in self._early.pop(key):
                arrival.drop()
        taken: list[tuple[int, Pending]] = []
        for key in [key for key in self._posted if dropped(key[1])]:
            taken.extend((key[0], pending) for pending in self._posted.pop(key))
        return taken
