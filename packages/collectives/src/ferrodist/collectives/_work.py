"""``Work`` handles for ``async_op=True`` calls, and the per-group worker that runs them in order."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from ferrodist.core import CollectiveTimeout, FerrodistError
from ferrodist.transport import Request

from ._failures.record import record_failure
from ._timeouts import seconds

#: The event of every work made finished (set once, never cleared).
_FINISHED = threading.Event()
_FINISHED.set()


class Work:
    """The handle an ``async_op=True`` call returns.

    ``wait(timeout)`` blocks until the operation finished and re-raises its error if it
    failed; ``is_completed()`` tells without blocking. The operation itself is bounded by
    its own timeout, so ``wait()`` without an argument cannot block forever.
    """

    def __init__(self, description: str) -> None:
        self._description = description
        self._done = threading.Event()
        self._error: BaseException | None = None

    @classmethod
    def finished(cls, description: str, error: BaseException | None) -> Work:
        """The work of a call that has already run (and failed with ``error``, if not None)."""
        work = cls.__new__(cls)
        work._description, work._done, work._error = description, _FINISHED, error
        return work

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        """True once completed without an error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The error the operation raised, if it completed with one."""
        return self._error if self._done.is_set() else None

    def wait(self, timeout: float | timedelta | None = None) -> None:
        """Block until the operation is done (at most ``timeout``: seconds or a ``timedelta``;
        0 looks without waiting) and re-raise its error if it failed.

        Raises:
            CollectiveTimeout: still running after ``timeout`` (it goes on; wait again).
            InvalidArgument: a negative, infinite or non-numeric ``timeout``.
        """
        limit = None if timeout is None else seconds(timeout, "Work.wait", zero=True)
        self._outcome(limit)

    def _outcome(self, limit: float | None) -> None:
        if not self._done.wait(limit):
            raise CollectiveTimeout(
                f"{self._description} is still running after wait({limit:g} s); "
                "wait again, or look at the ranks it exchanges with"
            )
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.is_completed() else "running")
        return f"<Work {self._description}: {state}>"


class RequestWork(Work):
    """A ``Work`` over one transport request (``isend`` / ``irecv``); a receive's ``source``
    is the group rank its message came from."""

    def __init__(
        self,
        description: str,
        request: Request,
        default_timeout: float,
        context: str,
        traced: Callable[[bool], None] | None = None,
        source: Callable[[], int | None] | None = None,
    ) -> None:
        super().__init__(description)
        self._request = request
        self._default_timeout = default_timeout
        self._context = context
        self._traced = traced  # records the message in the rank's trace when it ends (failed?)
        self._source = source

    @property
    def source(self) -> int | None:
        """The group rank a receive's message came from (a receive from any rank: once it
        has begun to arrive; ``wait()`` first); None for a send."""
        return None if self._source is None else self._source()

    def is_completed(self) -> bool:
        return self._done.is_set() or self._request.is_completed()

    def wait(self, timeout: float | timedelta | None = None) -> None:
        limit = self._default_timeout if timeout is None else seconds(timeout, "Work.wait", zero=True)
        if not self._done.is_set():
            try:
                self._request.wait(limit)
            except FerrodistError as exc:
                error = exc.with_context(self._context)
                if not isinstance(exc, CollectiveTimeout):  # a timeout of wait() may be retried
                    self._finish(error)
                    if self._traced is not None:
                        self._traced(True)
                record_failure(error)
                raise error from None
            self._finish(None)
            if self._traced is not None:
                self._traced(False)
        self._outcome(0)


class Worker:
    """One thread per group running async collectives in the order they were issued."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Work] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], work: Work) -> None:
        self._queue.put((fn, work))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, work = item
            try:
                fn()
            except BaseException as exc:
                work._finish(exc)
            else:
                work._finish(None)

    def stop(self, timeout: float) -> bool:
        """Stop after the queued work; True if the thread ended within ``timeout``."""
        self._queue.put(None)
        deadline = time.monotonic() + timeout
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()
