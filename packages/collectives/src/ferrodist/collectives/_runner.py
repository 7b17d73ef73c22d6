"""Running one group's calls: each numbered as issued, run in its turn (here or on the
group's async worker) under its deadline, and on failure framed and the group aborted.

A ``ProcessGroup`` checks arguments and plans the call (``_route``); it hands the
``Runner`` the plan (``run``) or a body of its own with a fingerprint (``launch``). A
planned call skips nothing of the order, the deadline or the failure handling.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ferrodist.core import CollectiveMismatch, FerrodistError, GroupAborted
from ferrodist.transport import Transport

from . import _trace
from ._call import MAX_USER_TAG, Call, Scratch, collective_tag
from ._debug import check_agreement
from ._failures import blame
from ._failures.record import record_failure
from ._fingerprint import describe, nbytes
from ._order import CallOrder
from ._timeouts import Timeout, seconds
from ._work import Work, Worker

Body = Callable[[Call], None]

if TYPE_CHECKING:
    from ._plan import Plan


def foreign(exc: Exception) -> FerrodistError:
    """A ferrodist error for an exception raised by other code inside a call (a CUDA
    library, a user's object): the call then fails, and the group aborts, on every rank,
    as for ferrodist's own errors; the original is the new error's ``__cause__``."""
    return FerrodistError(f"{type(exc).__name__}: {exc}")


class Runner:
    """The call machinery of one group on this rank."""

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int],
        group_id: int,
        *,
        name: str,
        timeout: float,
        debug: bool,
        member: Callable[[str], int],
    ) -> None:
        self.transport = transport
        self.ranks = tuple(ranks)
        self.group_id = group_id
        self.name = name
        self.timeout = timeout
        self.debug = debug
        self.member = member  # the group's check: this rank's group rank, or raise
        self.rank = self.ranks.index(transport.rank) if transport.rank in self.ranks else None
        self.order = CallOrder()
        self._tags = collective_tag(group_id, 0)  # a call's tag: this, with its number in the low bits
        self._peer_failure: tuple[int, FerrodistError] | None = (
            None  # (call, error) a peer failed before this rank entered it
        )
        self.scratch = Scratch()
        self.closed = False
        self._abort_hooks: list[Callable[[FerrodistError, int], None]] = []
        self._worker: Worker | None = None
        self._worker_lock = threading.Lock()
        # This rank's trace (FERRODIST_TRACE), or None: then a call pays one check.
        self.tracer = _trace.tracer(transport.rank) if self.rank is not None else None
        if self.rank is not None:
            transport.on_abort(group_id, self._respond)

    def launch(
        self,
        operation: str,
        body: Body,
        fp: int,
        *,
        async_op: bool,
        timeout: Timeout,
        shape: tuple[int, ...] = (),
        route: str = "",
        seq: int | None = None,
    ) -> Work | None:
        """Run ``body`` as the group's next call (now, or on the async worker), in the order
        the calls were issued (see ``_order``); ``seq``: its number, where the caller issued
        it already.

        ``fp`` is the call's fingerprint (see ``_fingerprint``): every message of the call
        carries it and the call's number, and a peer in another call is reported as a
        ``CollectiveMismatch``. In debug mode the ranks first compare ``fp`` and ``shape``
        (see ``_debug``). ``route`` names where it runs, for the trace.
        """
        rank = self.member(operation)
        limit = self.limit(timeout, operation)
        if seq is None:
            seq = self.order.issue()
        tracer = self.tracer
        issued = _trace.now() if tracer is not None else 0

        def run() -> None:
            started, failed = issued, True
            try:
                self._enter(seq, limit, operation)
                if tracer is not None:
                    started = _trace.now()
                self.order.entered = seq
                deadline = time.monotonic() + limit  # counted from the call's turn
                call = Call(self.transport, self.ranks, rank, self._tag(seq), deadline, self.scratch, fp, seq)
                if self.debug:
                    check_agreement(call, shape)
                body(call)
                failed = False
            except FerrodistError as exc:
                raise self._fail(exc, operation, seq).with_traceback(exc.__traceback__) from None
            except Exception as exc:  # not ours (a CUDA library's, a bug): fail the call everywhere too
                raise self._fail(foreign(exc), operation, seq).with_traceback(exc.__traceback__) from exc
            finally:
                self.order.done(seq)
                if tracer is not None:
                    self._traced(tracer, operation, seq, fp, route, issued, started, failed, async_op)

        if not async_op:
            run()
            return None
        work = Work(f"{operation} #{seq} on group {self.name}")
        self._get_worker().submit(run, work)
        return work

    def run(
        self, plan: Plan, arrays: tuple[Any, ...], async_op: bool, timeout: Timeout, shape: tuple[int, ...] = ()
    ) -> Work | None:
        """Run a planned call: ``plan.body(call, *arrays)``. With no option that needs the
        general path (async, a timeout of its own, debug mode's comparison of ``shape``), it
        runs here with nothing but the ordering, the deadline and the failure handling around it."""
        if async_op or timeout is not None or self.debug:
            if async_op and timeout is None and not self.debug and plan.native_call is not None:
                return self._small_async(plan, arrays)
            return self._launch_plan(plan, arrays, async_op, timeout, shape)
        rank = self.rank
        if rank is None or self.closed:
            rank = self.member(plan.operation)  # raises
        self._now(plan, arrays, rank, self.order.issue())
        return None

    def _launch_plan(
        self,
        plan: Plan,
        arrays: tuple[Any, ...],
        async_op: bool,
        timeout: Timeout,
        shape: tuple[int, ...],
        seq: int | None = None,
    ) -> Work | None:
        """``plan`` through ``launch``: its body bound to ``arrays``."""
        body = plan.body
        return self.launch(
            plan.operation,
            lambda call: body(call, *arrays),
            plan.fingerprint,
            async_op=async_op,
            timeout=timeout,
            shape=shape,
            route=plan.route,
            seq=seq,
        )

    def _small_async(self, plan: Plan, arrays: tuple[Any, ...]) -> Work | None:
        """An ``async_op=True`` call that the transport's own collective runs in one go (its
        ``native_call``: a few microseconds). When every call issued before it has finished
        here, it runs now and its work is done when it returns (on the worker it would cost
        ten times the call: two thread hand-overs); else it goes to the worker behind them.
        Its failure is the work's, raised by ``wait``, as on the worker."""
        rank = self.rank
        if rank is None or self.closed:
            rank = self.member(plan.operation)  # raises
        order = self.order
        seq = order.issue()
        if order.turn != seq or order.blocked is not None:
            return self._launch_plan(plan, arrays, True, None, (), seq)
        error: FerrodistError | None = None
        try:
            self._now(plan, arrays, rank, seq)
        except FerrodistError as exc:
            error = exc
        return Work.finished(f"{plan.operation} #{seq} on group {self.name}", error)

    def _now(self, plan: Plan, arrays: tuple[Any, ...], rank: int, seq: int) -> None:
        """Run call ``seq`` of ``plan`` on this thread, after the calls before it."""
        body = plan.body
        order = self.order
        tracer = self.tracer
        issued = started = _trace.now() if tracer is not None else 0
        failed = True
        try:
            if order.turn != seq or order.blocked is not None:
                self._enter(seq, self.timeout, plan.operation)
                if tracer is not None:
                    started = _trace.now()
            order.entered = seq
            deadline = time.monotonic() + self.timeout
            native_call = plan.native_call
            if native_call is not None:  # the transport's own collective, bound to this kind of call
                native_call(arrays[0], deadline, plan.fingerprint, seq)
            else:
                tag = self._tags | (seq & MAX_USER_TAG)
                call = Call(self.transport, self.ranks, rank, tag, deadline, self.scratch, plan.fingerprint, seq)
                body(call, *arrays)
            failed = False
        except FerrodistError as exc:
            raise self._fail(exc, plan.operation, seq).with_traceback(exc.__traceback__) from None
        except Exception as exc:
            raise self._fail(foreign(exc), plan.operation, seq).with_traceback(exc.__traceback__) from exc
        finally:
            order.done(seq)
            if tracer is not None:
                self._traced(tracer, plan.operation, seq, plan.fingerprint, plan.route, issued, started, failed, False)

    def _traced(
        self,
        tracer: _trace.Tracer,
        operation: str,
        seq: int,
        fp: int,
        route: str,
        issued: int,
        started: int,
        failed: bool,
        async_op: bool,
    ) -> None:
        """One event of this rank's trace for call ``seq``: from its turn to its end."""
        args: dict[str, object] = {"group": self.name, "call": seq, "bytes": nbytes(fp)}
        if fp:
            args["call_is"] = describe(fp)
        if route:
            args["route"] = route
        args["waited_for_turn_us"] = round((started - issued) / 1000, 1)
        if async_op:
            args["async"] = True
        if failed:
            args["failed"] = True
        tracer.event(operation, "collective", f"group {self.name}", started, _trace.now(), args)

    def limit(self, timeout: Timeout, operation: str) -> float:
        """A call's timeout: the caller's (seconds or a ``timedelta``, checked), or the group's."""
        if timeout is None:
            return self.timeout
        return seconds(timeout, operation, rank=self.transport.rank)

    def stop(self, timeout: float) -> None:
        """Finish queued async work (``timeout`` seconds at most) and stop the worker."""
        self.closed = True
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop(timeout)

    # -- internals ---------------------------------------------------------------------------
    def _tag(self, seq: int) -> int:
        return self._tags | (seq & MAX_USER_TAG)

    def _enter(self, seq: int, limit: float, operation: str) -> None:
        """Wait for call ``seq``'s turn; raise ``GroupAborted`` if the group was aborted.

        The calls before it end within their own deadlines (or fail, which blocks the
        group and wakes this wait), so the wait needs no deadline of its own: it has a
        safety bound of ``limit`` for itself and for each call ahead of it."""
        order = self.order
        if order.turn != seq:
            bound = time.monotonic() + limit * (1 + max(0, seq - order.turn))
            order.wait_turn(seq, bound, f"{operation} #{seq} on group {self.name}")
        blocked = order.blocked
        if blocked is not None:
            me = self.transport.rank
            failed = self._peer_failure
            if failed is not None and failed[0] == seq:
                # A peer found this very call mismatched before this rank entered it: a
                # mismatch is raised as a mismatch on every rank (a latecomer to a call that
                # timed out elsewhere gets GroupAborted, naming that failure).
                context = (
                    f"rank {me}: {operation} #{seq} on group {self.name} (group rank {self.rank} of {len(self.ranks)})"
                )
                raise blame.framed(failed[1], context, me, operation)
            raise GroupAborted(
                f"rank {me}: {operation} #{seq}: {blocked.message}", cause=blocked.cause, rank=me, operation=operation
            )

    def _fail(self, exc: FerrodistError, operation: str, seq: int) -> FerrodistError:
        """The error call ``seq`` raises: with its context; the group aborted on every rank
        (see ``_failure``)."""
        if isinstance(exc, GroupAborted):
            return exc
        me = self.transport.rank
        context = f"rank {me}: {operation} #{seq} on group {self.name} (group rank {self.rank} of {len(self.ranks)})"
        error = blame.abort(
            self.transport, self.group_id, self.ranks, seq, blame.framed(exc, context, me, operation), context
        )
        # Blocked after the census (no later call of the group runs before this one is done),
        # so that ``GroupAborted`` names the culprits the census found.
        self.order.block(blame.blocked(error, self.name, seq))
        record_failure(error)  # for the launcher: this rank's own error, or another rank's
        return error

    def abort(self, error: FerrodistError) -> None:
        """Abort the group from outside a call (a failure in code that drives it, such as a
        pipeline step): later calls here, and pending and later calls and messages of the
        group on every member, fail at once naming ``error``."""
        me, at = self.transport.rank, self.order.turn
        self.order.block(blame.blocked(error, self.name, at))
        self.transport.abort(self.group_id, error, peers=[r for r in self.ranks if r != me], seq=at)
        record_failure(error)

    def first_on_abort(self, hook: Callable[[FerrodistError, int], None]) -> None:
        """Call ``hook(error, seq)`` first whenever a peer's notice aborts this group (before
        this runner's own response, in the transport's thread): where the group's calls run
        over more than its own channel (two levels), the hook passes the abort on."""
        self._abort_hooks.append(hook)

    def _respond(self, error: FerrodistError, seq: int) -> None:
        """A peer aborted the group in its call ``seq`` (a transport thread calls this). A
        call in flight here fails on the aborted channel and answers for itself; between
        calls, the group is blocked here and the peers get this rank's notice at once, which
        tells their census that this rank is alive and which call it was at."""
        for hook in self._abort_hooks:
            hook(error, seq)
        order = self.order
        if order.entered == order.turn:
            return
        me, at = self.transport.rank, order.turn - 1
        if seq == order.turn and isinstance(error, CollectiveMismatch):
            self._peer_failure = (seq, error)
        # Point-to-point calls (a pipeline's) are not numbered: "before its first collective".
        when = f"after its call #{at}" if at >= 0 else "before its first collective there"
        context = f"rank {me}: group {self.name} {when} (group rank {self.rank} of {len(self.ranks)})"
        cause = blame.framed(error, context, me, error.operation or "collective")
        order.block(blame.blocked(cause, self.name, seq))
        notice = copy.copy(cause)
        notice.between = True  # tells the census: idle here, not stuck in a call
        self.transport.abort(self.group_id, notice, peers=[r for r in self.ranks if r != me], seq=at)

    def _get_worker(self) -> Worker:
        with self._worker_lock:
            if self._worker is None:
                self._worker = Worker(f"ferrodist-{self.name}-rank{self.transport.rank}")
            return self._worker
