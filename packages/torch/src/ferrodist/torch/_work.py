"""torch's ``Work`` for a ferrodist call: ``wait``, ``is_completed`` and ``get_future``.

A call issued with ``asyncOp`` runs on its ferrodist group's worker, in the order the
calls were issued; its ``FerrodistWork`` holds the ferrodist ``Work``. Torch code that
chains on completion (DDP's reducer, comm hooks) asks for a ``torch.futures.Future``
(``get_future``): a ``Completer`` thread per group waits for the group's calls in the
order they run and completes each future with the call's output tensors, or with its
error. Point-to-point calls do not finish in issue order, so each of their futures gets
a thread of its own. Whoever sees a call finish first (a ``wait``, the completer, an
``is_completed``) copies staged results back, once.

A failed call must fail its future in C++, where DDP's reducer reads it: Python's
``Future.set_exception`` only stores the exception as the future's *value* (torch's C++
then takes that value for the result and DDP's reducer crashed on it with SIGSEGV). So the
future handed out is ``trigger.then(outcome)``: the trigger is completed with ``None`` and
``outcome`` returns the output tensors or raises the call's error, which torch records as
the future's error (``RuntimeError: Got the following error when running the callback:
PeerLost: ...``; ``Work.wait`` raises the ferrodist class itself).
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ferrodist.core import InvalidArgument


def seconds(timeout: object, operation: str = "wait") -> float | None:
    """A torch timeout (``timedelta``, seconds, or ``None``/zero/negative for "the call's
    own deadline") as seconds or ``None``."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise InvalidArgument(f"{operation}: timeout must be a timedelta or seconds, not {timeout!r}")
    return value if value > 0 else None


class FerrodistWork(dist._Work):  # type: ignore[misc, name-defined]
    """The ``torch.distributed.Work`` of one call on the ferrodist backend.

    Args:
        description: the call, for messages (``"allreduce #3 on group 0"``).
        inner: the ferrodist ``Work`` of an async call; ``None`` for a call that has
            already run (then ``error`` is its failure, if it failed).
        result: the tensors the future carries (the call's outputs).
        finish: run once after a successful call (copies staged results back).
        completer: resolves futures in order; ``None`` for point-to-point calls.
        source: ``() -> int``: the rank a ``recv_anysource`` received from.
    """

    # What a finished, successful call has (``done`` sets only its description and result).
    _inner: Any = None
    _finish: Callable[[], None] | None = None
    _completer: Completer | None = None
    _source: Callable[[], int] | None = None
    _settled = True
    _error: BaseException | None = None
    _future: torch.futures.Future[Any] | None = None
    _trigger: torch.futures.Future[Any] | None = None
    _lock = threading.Lock()  # a done work's: held only while its future is made

    def __init__(
        self,
        description: str,
        inner: Any,
        result: list[torch.Tensor],
        *,
        finish: Callable[[], None] | None = None,
        completer: Completer | None = None,
        error: BaseException | None = None,
        source: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self._description = description
        self._inner = inner
        self._result = result
        self._finish = finish
        self._completer = completer
        self._source = source
        self._lock = threading.Lock()
        self._settled = inner is None
        self._error = error
        self._future: torch.futures.Future[Any] | None = None
        self._trigger: torch.futures.Future[Any] | None = None

    @classmethod
    def done(cls, description: str, result: list[torch.Tensor]) -> FerrodistWork:
        """The work of a call that has run and succeeded (made with less than ``__init__``
        does: it is made for every blocking call)."""
        work = cls.__new__(cls)
        dist._Work.__init__(work)  # type: ignore[attr-defined]
        work._description, work._result = description, result  # the rest: the class's
        return work

    def _settle(self, timeout: float | None) -> None:
        """Wait (``timeout`` seconds at most; ``None``: the call's own deadline) for the call
        and finish it; raise its error."""
        if not self._settled:
            try:
                self._inner.wait(timeout)
            except BaseException as exc:
                if not self._inner.is_completed():  # wait() ran out of time, the call goes on
                    raise
                with self._lock:
                    if not self._settled:
                        self._error, self._settled = exc, True
            with self._lock:
                if not self._settled:
                    try:
                        if self._finish is not None:
                            self._finish()
                    except BaseException as exc:
                        self._error = exc
                    self._settled = True
        if self._error is not None:
            raise self._error

    # -- torch's Work ---------------------------------------------------------------------------
    def wait(self, timeout: object = None) -> bool:
        """Block until the call has finished (``timeout`` at most) and raise its error."""
        self._settle(seconds(timeout))
        return True

    def is_completed(self) -> bool:
        if not self._settled and (self._inner is None or not self._inner.is_completed()):
            return False
        try:
            self._settle(None)  # done: finishing it does not block
        except BaseException:
            pass
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self.is_completed() else None

    def result(self) -> list[torch.Tensor]:
        self._settle(None)
        return self._result

    def _source_rank(self) -> int:
        self._settle(None)
        if self._source is None:
            raise InvalidArgument(f"{self._description}: only a receive from any source has a source rank")
        return self._source()

    def source_rank(self) -> int:
        return self._source_rank()

    def get_future(self) -> torch.futures.Future[Any]:
        """A future completed with the call's output tensors (or its error)."""
        with self._lock:
            future = self._future
            if future is not None:
                return future
            trigger = self._trigger = torch.futures.Future()
            future = self._future = trigger.then(self._outcome)
        if self._settled or (self._inner is not None and self._inner.is_completed()):
            self._resolve()
        elif self._completer is not None:
            self._completer.submit(self)
        else:
            threading.Thread(target=self._resolve, name="ferrodist-torch-p2p-future", daemon=True).start()
        return future

    def _resolve(self) -> None:
        """Finish the call (waiting for it) and complete the future's trigger with its
        error, or ``None``."""
        trigger = self._trigger
        assert trigger is not None
        failure: BaseException | None = None
        try:
            self._settle(None)
        except BaseException as exc:
            failure = exc
        trigger.set_result(failure)

    def _outcome(self, trigger: torch.futures.Future[Any]) -> list[torch.Tensor]:
        """The future's value: the output tensors, or the call's error raised."""
        failure = trigger.value()
        if failure is not None:
            # torch puts the traceback in the future's message: leave the worker's frames out
            raise _bare(failure)
        return self._result

    def __repr__(self) -> str:
        state = "running" if not self._settled else ("failed" if self._error is not None else "done")
        return f"<FerrodistWork {self._description}: {state}>"


class Completer:
    """One thread per group completing the futures of its collectives in the order issued
    (they run in that order); started by the first future asked for."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[FerrodistWork | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work: FerrodistWork) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(work)

    def _loop(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            work._resolve()

    def stop(self, timeout: float) -> None:
        """Stop after the futures queued so far (``timeout`` seconds at most)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)


def _bare(error: BaseException) -> BaseException:
    """A copy of ``error`` without its traceback (``error`` itself if it cannot be copied)."""
    try:
        clone = copy.copy(error)
    except Exception:
        return error
    return clone.with_traceback(None)
