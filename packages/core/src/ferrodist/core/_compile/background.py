"""Kernels called from Python never compile in the caller's thread, nor hold its GIL.

Numba compiles a function for new argument types when it is first called with them, in
the calling thread: 1-7 s per shared-memory pipeline and dtype on a 2-core machine. Inside
a collective that counted against the call's deadline, and the peer waiting for it timed
out. Here a kernel called from Python goes through a *front* (:func:`background`): a
dispatcher of the same function that never compiles. It runs the code already compiled for
the arguments' types; without that, it raises :class:`NotCompiled` at once, before any of
the function runs. The caller then runs an interpreted path that gives the same results
(the numpy reductions of ``_interpreted``, the shared-memory protocol step by step in
Python) and queues the compile with :func:`prepare`. One thread per process works through
the queue in order and hands the code to the fronts; later calls run it.

The thread loads what Numba's disk cache holds. What it does not hold is compiled by the
process's compile helper (``helper``): another process, at a lower CPU priority, that
writes the code to the cache while this thread waits without the GIL, then loads it. A
compile in this process would hold the GIL for seconds (Numba compiles in Python), and
the training thread beside it would get it only every few milliseconds. The processes of
a host compile each function once, under a lock of the cache. Code that a caller waits for
(``prepare(..., always=True)``: the shared-memory waits, at a transport's start) compiles
in this thread, under the same lock: a helper's start would only add to the wait.

Loading takes Numba's global lock, compiled code runs without it (and, with
``nogil=True``, without the GIL), so the background holds up no call. The foreground never
takes that lock once its transport is connected: a first call, warm cache or cold, runs
interpreted and never waits.

The thread is a daemon, and an exit must not tear LLVM's globals down while that thread
is inside LLVM (LLVM runs without the GIL: the process crashed with SIGSEGV, or SIGABRT,
after the job's work was done). So an exit drops the queue, lets the helper go (it ends
after the compile in progress, whose code still reaches the cache) and takes llvmlite's
lock, which every call into LLVM holds: it waits for the LLVM call in progress (well under
a second), and the thread then stops at its next one, for good. Without that lock
(another llvmlite), the exit waits for the function being loaded or compiled. A fork
waits for the compile in progress (the child gets a free compiler lock) and the child
starts a thread and, when it needs one, a helper of its own for what is still queued.
``FERRODIST_KERNELS=interpreted`` queues nothing but what must be compiled (the
shared-memory waits): every call runs the interpreted paths. ``FERRODIST_DEBUG=compile``
logs each load and compile with its time.
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

# Numba itself first: that waits for another thread's import of it to finish, where importing
# one of its submodules alone would run beside it (they import each other: partial modules).
import numba  # noqa: F401
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import CPUDispatcher

from ferrodist.core._errors import FerrodistError

from .helper import Helper, HelperGone, Recipe, compile_here, in_cache

__all__ = ["NotCompiled", "Ticket", "background", "prepare", "wait_for_compiles"]


class NotCompiled(FerrodistError):
    """A front has no compiled code for these argument types yet; raised before anything
    runs, so the caller can run its interpreted path. ferrodist catches it everywhere it
    calls a front: one that reaches a user is a bug."""

    def __init__(self, front: Front, types: tuple[Any, ...]) -> None:
        super().__init__(
            f"{front.py_func.__qualname__} has no compiled code for {types} yet (it compiles in the background); "
            "this error should have been caught by ferrodist: please report it"
        )
        self.front = front
        self.types = types


class Front(CPUDispatcher):
    """A dispatcher that runs the compiled code of ``source`` (another dispatcher of the same
    function) and never compiles: a call for argument types it has no code for raises
    :class:`NotCompiled`. Code reaches it through :func:`prepare`."""

    def __init__(self, source: Any, recipe: Recipe | None) -> None:
        super().__init__(source.py_func, targetoptions={"nopython": True, "nogil": True})
        self._can_compile = False
        self.source = source
        self.recipe = recipe  # how the compile helper gets ``source``; None: compiled here

    def add_overload(self, cres: Any) -> None:
        """Add compiled code, from the compiling thread, without touching the table a caller's
        thread may be reading: Numba walks ``overloads`` when a call's types match no code
        exactly (``nopython_signatures``, to look for conversions), and an OrderedDict that
        grows during that walk raises ``RuntimeError: OrderedDict mutated during iteration``
        in the caller. The new code goes into a copy, which then replaces the table."""
        table = collections.OrderedDict(self.overloads)
        args = tuple(cres.signature.args)
        table[args] = cres
        self._insert([a._code for a in args], cres.entry_point, cres.objectmode)  # type: ignore[attr-defined]
        self.overloads = table

    def _explain_matching_error(self, *args: Any, **kws: Any) -> None:
        raise NotCompiled(self, tuple(self.typeof_pyval(a) for a in args))

    _explain_ambiguous = _explain_matching_error


@functools.cache
def background(dispatcher: Any) -> Front:
    """The front of ``dispatcher`` (a function of ``jit``): call it from Python instead of
    the dispatcher, catch :class:`NotCompiled`, and on it run an interpreted path and
    ``prepare([(error.front, error.types)])``. One front per dispatcher, kept for the
    process (a front's overloads are the dispatcher's own code). Its compiles run in the
    compile helper when another process can make the same dispatcher (``Recipe.of``: one
    bound to a name of its module, or made by a factory that said how), else here."""
    return Front(dispatcher, Recipe.of(dispatcher))


class Ticket:
    """What one :func:`prepare` queued. ``ready`` turns True once every function of it
    runs through its front; ``failed`` holds the reason when a compile raised (the
    interpreted path then stays in use)."""

    def __init__(self) -> None:
        self.ready = False
        self.failed: str | None = None
        self.urgent = False  # code a caller waits for (no interpreted path): compiled first
        self._done = threading.Event()

    def wait(self, timeout: float) -> bool:
        """Block until the compiles are done, at most ``timeout`` seconds; True if ready."""
        self._done.wait(max(0.0, timeout))
        return self.ready

    def _finish(self, failed: str | None = None) -> None:
        self.failed = failed
        self.ready = failed is None
        self._done.set()


Item = tuple[Front, tuple[Any, ...]]

#: The longest an exiting process waits for the compile in progress (one function compiles
#: in at most a few seconds; a process that cannot wait is killed, not exited).
EXIT_WAIT = 120.0


class _Exiting(Exception):
    """The process exits: the rest of a job is not compiled."""


class _Compiler:
    """The queue of compiles and the thread that works through it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: collections.deque[tuple[tuple[Item, ...], Ticket]] = collections.deque()
        self._tickets: dict[tuple[Item, ...], Ticket] = {}
        self._current: tuple[tuple[Item, ...], Ticket] | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._hooked = False
        self._helper = Helper()

    def prepare(self, items: tuple[Item, ...], always: bool) -> Ticket:
        with self._lock:
            ticket = self._tickets.get(items)
            if ticket is not None:
                return ticket
            ticket = self._tickets[items] = Ticket()
            if all(types in front.overloads for front, types in items):  # another request brought them
                ticket._finish()
                return ticket
            if not always and os.environ.get("FERRODIST_KERNELS", "") == "interpreted":
                return ticket  # never ready: the interpreted paths only
            ticket.urgent = always
            # Code with no interpreted path is waited for: it goes ahead of everything queued
            # that has one (after what is waited for already), not behind seconds of it.
            ahead = len(self._queue)
            if always:
                ahead = next((i for i, (_, queued) in enumerate(self._queue) if not queued.urgent), ahead)
            self._queue.insert(ahead, (items, ticket))
            self._start()
            self._changed.notify_all()
        return ticket

    def _start(self) -> None:
        """Start the thread if there is none (the caller holds the lock); the first time,
        hook the process's exit and forks."""
        if self._thread is not None or self._closing:
            return
        if not self._hooked:
            self._hooked = True
            atexit.register(self.close)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(
                    before=self.before_fork,
                    after_in_parent=self.after_fork_in_parent,
                    after_in_child=self.after_fork_in_child,
                )
        self._thread = threading.Thread(target=self._run, name="ferrodist-compile", daemon=True)
        self._thread.start()

    def wait_idle(self, timeout: float | None) -> bool:
        give_up = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queue or self._current is not None:
                left = None if give_up is None else give_up - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if self._closing:
                    return
                self._current = job = self._queue.popleft()
            items, ticket = job
            failed = None
            try:
                compiled = []
                for front, types in items:
                    if self._closing:  # the process exits: compile no more
                        raise _Exiting
                    compiled.append((front, self._obtain(front, types, ticket.urgent)))
                for front, result in compiled:  # in order: the entry the caller calls first comes last
                    if tuple(result.signature.args) not in front.overloads:
                        front.add_overload(result)
            except _Exiting:
                failed = "the process exits"
            except Exception as exc:  # the interpreted path stays; say why once
                failed = f"{type(exc).__name__}: {exc}"
                names = ", ".join(front.py_func.__qualname__ for front, _ in items)
                warnings.warn(
                    f"ferrodist: compiling {names} failed ({failed}); its interpreted path stays in use",
                    RuntimeWarning,
                    stacklevel=1,
                )
            ticket._finish(failed)
            with self._lock:
                self._current = None
                self._changed.notify_all()

    def _obtain(self, front: Front, types: tuple[Any, ...], urgent: bool) -> Any:
        """The compile result of ``front``'s function for ``types``: loaded from the disk
        cache, after the helper has put it there when it was missing (code nobody waits
        for), or compiled here."""
        source, started = front.source, time.perf_counter()
        how = "loaded" if in_cache(source, types) else "compiled here"
        if how != "loaded" and not urgent and front.recipe is not None and not self._helper.broken:
            try:
                failed = self._helper.compile(front.recipe, types)
            except HelperGone:
                pass  # no helper (it could not start, or died): compiled here, as before
            else:
                if failed is not None:
                    raise RuntimeError(failed)
                how = "compiled by the helper, loaded"
        result = compile_here(source, types)
        if _log_compiles():
            took = time.perf_counter() - started
            print(f"ferrodist compile: {front.py_func.__qualname__}{types}: {how} in {took:.2f} s", file=sys.stderr)
        return result

    def close(self, timeout: float = EXIT_WAIT) -> None:
        """At exit: drop the queue; if a compile is in progress, make sure that it is out of
        LLVM and stays out (see the module docstring), within ``timeout`` seconds."""
        with self._lock:
            self._closing = True
            dropped = list(self._queue)
            self._queue.clear()
            self._changed.notify_all()
            busy = self._current is not None
        for _, ticket in dropped:
            ticket._finish("the process exits")
        self._helper.close()
        if not busy:
            return
        llvm = _llvm_lock()
        if llvm is not None and llvm.acquire(timeout=timeout):
            return  # held until the process ends; this thread may still call LLVM (re-entrant)
        with self._lock:
            give_up = time.monotonic() + timeout
            while self._current is not None and time.monotonic() < give_up:
                self._changed.wait(give_up - time.monotonic())

    # -- fork -----------------------------------------------------------------------------------
    def before_fork(self) -> None:
        global_compiler_lock.acquire()  # waits for the compile in progress
        self._lock.acquire()

    def after_fork_in_parent(self) -> None:
        self._lock.release()
        global_compiler_lock.release()

    def after_fork_in_child(self) -> None:
        self._thread = None  # not copied by fork
        self._helper.forget()  # the parent's; the child starts one when it needs one
        if self._current is not None:  # popped, not finished: do it again (compiled already)
            self._queue.appendleft(self._current)
            self._current = None
        if self._queue:
            self._start()
        self._lock.release()
        global_compiler_lock.release()


def _llvm_lock() -> Any:
    """The re-entrant lock llvmlite holds around every call into LLVM, or None when this
    llvmlite keeps it elsewhere."""
    from llvmlite.binding import ffi

    lock = getattr(getattr(getattr(ffi, "lib", None), "_lock", None), "_lock", None)
    return lock if callable(getattr(lock, "acquire", None)) else None


@functools.cache
def _log_compiles() -> bool:
    return "compile" in os.environ.get("FERRODIST_DEBUG", "").split(",")


_COMPILER = _Compiler()


def prepare(items: Iterable[tuple[Front, Sequence[Any]]], *, always: bool = False) -> Ticket:
    """Queue the compile of each ``(front, argument types)`` on the background thread, in
    order; their fronts get the code together once all are compiled, the first item's
    first and the last item's last (list an entry point after the functions it calls from
    Python when it returns early, so that a front that runs the entry finds the others
    ready). The same request again returns the same ticket; one whose every function has
    its code already (another request brought it) is ready at once.

    ``always``: code with no interpreted path, which a caller waits for: compiled even under
    ``FERRODIST_KERNELS=interpreted``, and ahead of every queued request that has one."""
    return _COMPILER.prepare(tuple((front, tuple(types)) for front, types in items), always)


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Block until every compile queued so far is done (at most ``timeout`` seconds);
    True if none is left. A short job that wants the next one warm calls this last."""
    return _COMPILER.wait_idle(timeout)
