"""The order of one group's calls: numbered as issued, run one at a time in that order.

Every rank numbers a group's collectives in the order its program issues them, from any
thread, blocking or ``async_op=True``; call ``n`` runs only after call ``n - 1`` has
finished on this rank. So the ``n``-th calls of all ranks meet (their messages and
shared-memory slots carry ``n``), an async call never races a blocking one for the
group's scratch space, and two threads on one group cannot interleave their steps.

Once a call fails, the group is *blocked*: every later call raises ``GroupAborted`` at
once, and calls waiting for their turn wake up to raise it.
"""

from __future__ import annotations

import itertools
import threading
import time

from ferrodist.core import CollectiveTimeout, GroupAborted


class CallOrder:
    """Numbers and turns of one group's calls on this rank."""

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self.turn = 0  # the number of the call that may run now
        self.entered = -1  # the last call that began to run (a call runs while entered == turn)
        self._waiters = 0
        self._cond = threading.Condition(threading.Lock())
        self.blocked: GroupAborted | None = None  # set once, when a call fails

    def issue(self) -> int:
        """The next call's number (atomic: ``itertools.count`` under the GIL)."""
        return next(self._numbers)

    def wait_turn(self, seq: int, deadline: float, what: str) -> None:
        """Block until call ``seq`` may run (the calls before it have finished here), or
        the group is blocked (the caller then raises), or ``deadline`` passes."""
        with self._cond:
            self._waiters += 1  # before looking at the turn: ``done`` reads it after its write
            try:
                while self.turn != seq and self.blocked is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CollectiveTimeout(
                            f"{what} waited its whole timeout for the calls issued before it on this rank "
                            f"(call #{self.turn} and later) to finish"
                        )
                    self._cond.wait(left)
            finally:
                self._waiters -= 1

    def done(self, seq: int) -> None:
        """Call ``seq`` has finished (or failed): the next one may run."""
        self.turn = seq + 1
        if self._waiters:
            with self._cond:
                self._cond.notify_all()

    def block(self, error: GroupAborted) -> None:
        """Fail every later call with ``error`` (the first error stays)."""
        with self._cond:
            if self.blocked is None:
                self.blocked = error
            self._cond.notify_all()
