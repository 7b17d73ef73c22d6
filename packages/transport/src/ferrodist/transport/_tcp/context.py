"""What the links of one TCP transport share (as Gloo's tcp ``Context`` is to its pairs),
handed to each link when it is made: this rank, the condition every wait for a message
sleeps on, the aborted channels, the peers that are gone and why, the mailboxes, and what
the transport sets for all its links (how often a wait gives its core away, whether the
transport is closing). The waits and failures that concern more than one link are here:
a receive from any of several senders, an abort of a channel, a lost peer.
"""

from __future__ import annotations

import threading
import time

from ferrodist.core import CollectiveTimeout, FerrodistError
from ferrodist.core.kernels import Later
from ferrodist.transport._aborts import Aborts, channel_of, fresh
from ferrodist.transport._checks import lost_sender, receive_timeout, receiving

from . import compiled
from .mailbox import Mailboxes
from .records import Pending

__all__ = ["Context"]


class Context:
    """The state a transport's links share; ``cond`` guards the mailboxes and ``lost``."""

    def __init__(self, rank: int, max_frame: int) -> None:
        self.rank = rank
        self.max_frame = max_frame  # the longest payload a frame's header may announce
        self.cond = threading.Condition()
        self.mailboxes = Mailboxes()  # posted receives and early arrivals, under cond
        self.aborts = Aborts()
        self.lost: dict[int, FerrodistError] = {}  # peer (or this rank: stopped, closed) -> why
        self.stopped: dict[int, set[int]] = {}  # channel -> senders of the receives its abort failed
        self.yields = 0  # how often a wait gives the core away before it sleeps (see share_host)
        # the links' compiled frame calls: queued once they have run in Python WORTH_COMPILING times
        self.frames = Later(compiled.frame_kernels, compiled.WORTH_COMPILING)
        self.closing = False

    def lose(self, peer: int, error: FerrodistError, taker: Pending | None = None) -> None:
        """Record that ``peer`` is gone (or its stream is corrupt) and wake every waiter;
        ``taker``, the receive that was being filled from it, fails with ``error``."""
        with self.cond:
            self.lost.setdefault(peer, error)
            if taker is not None:
                taker.error = error
                taker.done = True
            self.cond.notify_all()

    def refuse(self, pending: Pending) -> bool:
        """Fail ``pending`` at once if its channel is aborted (the caller holds ``cond``)."""
        aborted = self.aborts.error(channel_of(pending.tag))
        if aborted is None:
            return False
        awaited = pending.src if pending.sources is None else None
        pending.error, pending.done = fresh(aborted, f"rank {self.rank}: {receiving(pending)}", awaited), True
        return True

    def post_any(self, pending: Pending) -> None:
        """Post a receive from whichever of ``pending.sources`` sends first."""
        with self.cond:
            if not self.refuse(pending):
                self.mailboxes.post_any(pending)

    def wait(self, pending: Pending, limit: float, deadline: float | None = None) -> None:
        """Block until ``pending`` is done (its error raised), a failure ends it (its
        channel's abort, this rank's stop, the loss of its senders), or ``deadline`` passes
        (default: ``limit`` seconds from now). A receive that nothing has claimed is taken
        back before it raises."""
        if deadline is None:
            deadline = time.monotonic() + limit
        channel, rank = channel_of(pending.tag), self.rank
        with self.cond:
            while not pending.done:
                # an abort comes before the departure that follows it
                failure = self.aborts.error(channel) or self.lost.get(rank) or lost_sender(self.lost, pending.senders)
                if failure is not None and not pending.claimed:
                    self.mailboxes.withdraw(pending)
                    awaited = pending.src if pending.sources is None else None
                    raise fresh(failure, f"rank {rank} was waiting for {receiving(pending, 'a message')}", awaited)
                left = deadline - time.monotonic()
                if left <= 0:
                    if not pending.claimed:
                        self.mailboxes.withdraw(pending)
                        raise receive_timeout(rank, pending.senders, pending.tag, limit)
                    raise CollectiveTimeout(
                        f"rank {rank} waited {limit:g} s for a message from rank {pending.src} (tag "
                        f"{pending.tag:#x}): it began to arrive, then stopped in the middle; rank {pending.src} is "
                        "stuck or overloaded (the rest still lands in the buffer if it comes)",
                        rank=rank,
                        waiting_for=(pending.src,),
                    )
                self.cond.wait(left)
        if pending.error is not None:
            raise pending.error

    def abort_here(self, channel: int, error: FerrodistError, heard: tuple[int, int] | None = None) -> None:
        """Record the abort of ``channel`` (``heard``: a peer's notice, its rank and call),
        drop what arrived for the channel and fail its posted receives."""
        if heard is not None:
            self.aborts.hear(channel, heard[0], heard[1], error)
        else:
            self.aborts.record(channel, error)
        first = self.aborts.error(channel)
        assert first is not None
        with self.cond:
            for pending in self.mailboxes.clear(lambda tag: channel_of(tag) == channel):
                awaited = pending.src if pending.sources is None else None
                pending.error, pending.done = fresh(first, f"rank {self.rank}: {receiving(pending)}", awaited), True
                self.stopped.setdefault(channel, set()).update(pending.senders)
            self.cond.notify_all()
