"""The receives a TCP transport has posted and the messages that arrived before theirs,
matched by (sender, tag) in the order each side came, and the wait for a receive.

Every method but ``wait`` runs under the transport's condition (``cond``), which its
receiver threads and its waiting callers share; the transport wakes the waiters.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import numpy as np

from ferrodist.core import CollectiveTimeout, FerrodistError
from ferrodist.transport._aborts import fresh
from ferrodist.transport._checks import check_match, receive_timeout, receiving

from .records import Arrival, Pending


class Mailbox:
    """One transport's posted receives and early arrivals.

    A receive from any of several senders (``post_any``) competes with the receives that
    name one sender: a message goes to whichever of those posted first that can take it,
    and such a receive posted after messages came takes the one that came first.
    """

    def __init__(self, rank: int, cond: threading.Condition) -> None:
        self.rank = rank
        self.cond = cond
        self._posted: dict[tuple[int, int], collections.deque[Pending]] = collections.defaultdict(collections.deque)
        self._early: dict[tuple[int, int], collections.deque[Arrival]] = collections.defaultdict(collections.deque)
        self._anywhere: dict[int, list[Pending]] = {}  # tag -> receives from any of several senders, in order
        self._order = 0  # receives queued and messages kept, numbered as they come

    def _next(self) -> int:
        self._order += 1
        return self._order

    def arriving(self, src: int, tag: int, fingerprint: int, length: int) -> tuple[Pending | None, Arrival | None]:
        """A message's header has come from ``src``: the posted receive that takes it (now
        claimed), or the record it is kept in until its receive is posted."""
        key = (src, tag)
        queue = self._posted.get(key)
        pending = queue[0] if queue else None
        rival = self._waiting_for(src, tag) if self._anywhere else None
        if rival is not None and (pending is None or rival.order < pending.order):
            self._unqueue_any(rival)
            rival.src, pending = src, rival
        elif pending is not None:
            queue.popleft()  # type: ignore[union-attr]
            if not queue:
                del self._posted[key]
        if pending is not None:
            pending.claimed = True
            return pending, None
        arrival = Arrival(tag, fingerprint, length, self._next())  # pieces are allocated as its bytes come
        self._early[key].append(arrival)
        return None, arrival

    def quiet(self, src: int, tag: int) -> bool:
        """No receive from ``src`` with ``tag`` is posted and no such message kept: the next
        one to arrive is the next receive's."""
        return (
            not self._posted.get((src, tag))
            and not self._early.get((src, tag))
            and not (self._anywhere and self._waiting_for(src, tag))
        )

    def post(self, pending: Pending, src: int) -> None:
        """A receive from ``src``: matched with the first message that came before it (whole,
        or still arriving: its header says at once whether it fits), else queued."""
        pending.src = src
        key = (src, pending.tag)
        if self._early.get(key):
            self._take(pending, key)
        else:
            pending.order = self._next()
            self._posted[key].append(pending)

    def post_any(self, pending: Pending) -> None:
        """A receive from whichever of ``pending.sources`` sends first: matched with the
        message from one of them that came first, else queued."""
        tag, first = pending.tag, None
        for src in pending.sources or ():
            kept = self._early.get((src, tag))
            if kept and (first is None or kept[0].order < self._early[first][0].order):
                first = (src, tag)
        if first is not None:
            pending.src = first[0]
            self._take(pending, first)
        else:
            pending.order = self._next()
            self._anywhere.setdefault(tag, []).append(pending)

    def _take(self, pending: Pending, key: tuple[int, int]) -> None:
        """Match ``pending`` with the first message kept under ``key``."""
        arrived = self._early[key]
        arrival = arrived.popleft()
        if not arrived:
            del self._early[key]
        if arrival.done:
            self.fill(pending, key[0], arrival)
            return
        pending.error = check_match(
            self.rank, key[0], pending.tag, pending.buf.nbytes, pending.fingerprint, arrival.length, arrival.fingerprint
        )
        if pending.error is None:
            arrival.taker, pending.claimed = pending, True
        else:
            arrival.drop()  # read to its end through a scratch buffer, then forgotten
            pending.done = True

    def _waiting_for(self, src: int, tag: int) -> Pending | None:
        """The first receive from any of several senders that would take ``src``'s message."""
        return next((p for p in self._anywhere.get(tag, ()) if src in p.sources), None)  # type: ignore[operator]

    def _unqueue_any(self, pending: Pending) -> None:
        waiting = self._anywhere[pending.tag]
        waiting.remove(pending)
        if not waiting:
            del self._anywhere[pending.tag]

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

    def wait(self, pending: Pending, deadline: float, limit: float, ended: Callable[[], FerrodistError | None]) -> None:
        """Block until ``pending`` is done (its error raised), ``ended()`` names a failure
        that ends it, or ``deadline`` passes (``limit``: the seconds it had). A receive that
        nothing has claimed is taken back before it raises."""
        with self.cond:
            while not pending.done:
                failure = ended()
                if failure is not None and not pending.claimed:
                    self.withdraw(pending)
                    awaited = pending.src if pending.sources is None else None
                    raise fresh(failure, f"rank {self.rank} was waiting for {receiving(pending, 'a message')}", awaited)
                left = deadline - time.monotonic()
                if left <= 0:
                    if not pending.claimed:
                        self.withdraw(pending)
                        raise receive_timeout(self.rank, pending.senders, pending.tag, limit)
                    raise CollectiveTimeout(
                        f"rank {self.rank} waited {limit:g} s for a message from rank {pending.src} (tag "
                        f"{pending.tag:#x}): it began to arrive, then stopped in the middle; rank {pending.src} is "
                        "stuck or overloaded (the rest still lands in the buffer if it comes)",
                        rank=self.rank,
                        waiting_for=(pending.src,),
                    )
                self.cond.wait(left)
        if pending.error is not None:
            raise pending.error

    def withdraw(self, pending: Pending) -> None:
        """Take back a receive nothing has claimed (its wait failed)."""
        if pending.sources is not None:
            if pending in self._anywhere.get(pending.tag, ()):
                self._unqueue_any(pending)
            return
        queue = self._posted.get((pending.src, pending.tag))
        if queue is not None and pending in queue:
            queue.remove(pending)

    def clear(self, dropped: Callable[[int], bool]) -> list[Pending]:
        """Forget the early arrivals whose tag is ``dropped`` (read to their end, then
        forgotten) and take back those tags' posted receives, for the caller to fail."""
        for key in [key for key in self._early if dropped(key[1])]:
            for arrival in self._early.pop(key):
                arrival.drop()
        taken: list[Pending] = []
        for key in [key for key in self._posted if dropped(key[1])]:
            taken.extend(self._posted.pop(key))
        for tag in [tag for tag in self._anywhere if dropped(tag)]:
            taken.extend(self._anywhere.pop(tag))
        return taken
