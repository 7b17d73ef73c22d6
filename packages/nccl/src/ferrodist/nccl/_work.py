"""``NcclWork``: the ``Work`` of an NCCL operation, a CUDA event polled against a timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from . import _cuda

__all__ = ["NcclWork"]


class Waiter(Protocol):
    """What a work waits through: its communicator, which polls NCCL's errors beside ``done``."""

    def wait_until(self, done: Callable[[], bool], operation: str, timeout: float | None = None) -> None: ...


class NcclWork:
    """Completes when the GPU has run everything enqueued before it (satisfies core's ``Work``).

    ``wait()`` polls the event and NCCL's asynchronous error state; past the timeout it aborts
    the communicator and raises ``CollectiveTimeout``. A failure is raised again by every
    later ``wait()``.
    """

    def __init__(self, communicator: Waiter, event: int, operation: str, timeout: float) -> None:
        self._communicator = communicator
        self._event: int | None = event
        self._operation = operation
        self._timeout = timeout
        self._error: BaseException | None = None

    @property
    def operation(self) -> str:
        return self._operation

    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation finished on the GPU; re-raise its error if it failed."""
        if self._error is not None:
            raise self._error
        event = self._event
        if event is None:
            return
        try:
            self._communicator.wait_until(
                lambda: _cuda.query_event(event), self._operation, self._timeout if timeout is None else timeout
            )
        except BaseException as exc:
            self._error = exc
            self._release()
            raise
        self._release()

    def is_completed(self) -> bool:
        """True once finished, successfully or not (never blocks)."""
        if self._event is None or self._error is not None:
            return True
        try:
            done = _cuda.query_event(self._event)
        except BaseException as exc:
            self._error = exc
            self._release()
            return True
        if done:
            self._release()
        return done

    def _release(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            try:
                _cuda.destroy_event(event)
            except Exception as exc:  # keep the first error, report this one only if there was none
                if self._error is None:
                    self._error = exc

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._event is None else "pending"
        return f"NcclWork({self._operation!r}, {state})"
