"""Watching one node's ranks: the signals the launcher receives (``Signals``), the order the
ranks exit in (``Watch``), and ``supervise``: wait for them, stop them after a failure (or
more failures than an elastic job tolerates) or a signal, and reap them all."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from ._nodes.hub import Hub
from ._nodes.joins import LOOK
from ._nodes.link import HEARTBEAT
from ._nodes.member import Member
from ._output import Console
from ._verdict import describe, signal_name

#: The signals the launcher passes on to the ranks.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Signals:
    """SIGINT, SIGTERM and SIGHUP sent to the launcher, queued on a pipe the supervisor
    sleeps on. Handlers can only be installed from the main thread; elsewhere none are."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in FORWARDED:
                self._previous[signum] = signal.signal(signum, self._handle)

    seen = False  # a signal arrived (then the job is not restarted)

    def _handle(self, signum: int, _frame: object) -> None:
        self.seen = True
        with contextlib.suppress(OSError):
            os.write(self._write, bytes([signum]))

    def take(self) -> int | None:
        """The next signal received, or ``None``."""
        try:
            data = os.read(self.fd, 1)
        except BlockingIOError:
            return None
        return data[0] if data else None

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self.fd)
        os.close(self._write)


class Watch:
    """The ranks as the supervisor sees them: the order they exit in (from their pidfds, or
    polling every 50 ms where there are none), and the signal it first sent each rank
    that was still running."""

    def __init__(
        self, procs: list[subprocess.Popen[bytes]], signals: Signals, link: Hub | Member | None = None
    ) -> None:
        self.procs = procs
        self.signals = signals
        self.link = link
        self.started = time.monotonic()
        self.exited: list[int] = []
        self.exited_at: dict[int, float] = {}
        self.stopped: dict[int, int] = {}
        self._pidfds: dict[int, int] = {}  # rank -> pidfd, while it runs
        self._polling = False
        for rank, proc in enumerate(procs):
            try:
                self._pidfds[rank] = os.pidfd_open(proc.pid)
            except (AttributeError, OSError):
                break
        else:
            return
        self.close()  # some but not all: poll them all
        self._polling = True

    def order(self, rank: int) -> int:
        return self.exited.index(rank) if rank in self.exited else len(self.exited)

    def running(self) -> list[int]:
        return [rank for rank in range(len(self.procs)) if rank not in self.exited]

    def failed(self) -> list[int]:
        """The ranks that exited non-zero or died, in the order they did."""
        return [rank for rank in self.exited if self.procs[rank].returncode != 0]

    def failures(self) -> int:
        return len(self.failed())

    def restart(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """``proc`` (already in ``procs``) runs in the place of ``rank``, which had exited."""
        self.exited.remove(rank)
        self.exited_at.pop(rank, None)
        if not self._polling:
            self._pidfds[rank] = os.pidfd_open(proc.pid)

    def wait(self, deadline: float | None) -> int | None:
        """Sleep until a rank exits, a signal arrives, or ``deadline`` (monotonic) passes;
        returns the signal, if one arrived."""
        signum = self.signals.take()
        if signum is None and not self._reap():
            polling = not self._pidfds and bool(self.running())
            timeout = 0.05 if polling else 1.0
            links = self.link.fds() if self.link is not None else []
            if self.link is not None:
                timeout = min(timeout, HEARTBEAT if self.link.joins is None else LOOK)
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.monotonic()))
            select.select([self.signals.fd, *self._pidfds.values(), *links], [], [], timeout)
            signum = self.signals.take()
        self._reap()
        if self.link is not None:
            self.link.poll()
        return signum

    def send(self, signum: int) -> None:
        """``signum`` to every rank's process group (a rank that exited may have left
        children there); a rank still running counts as stopped by it."""
        self._reap()
        for rank, proc in enumerate(self.procs):
            if rank not in self.exited:
                self.stopped.setdefault(rank, signum)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)  # the rank and anything it started

    def groups_alive(self) -> bool:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                continue
            return True
        return False

    def _reap(self) -> bool:
        """Note the ranks that exited since last time; True if there was one."""
        found = False
        for rank, proc in enumerate(self.procs):
            if rank not in self.exited and proc.poll() is not None:
                self.exited.append(rank)
                self.exited_at[rank] = time.monotonic()
                found = True
                fd = self._pidfds.pop(rank, None)
                if fd is not None:
                    os.close(fd)
        return found

    def close(self) -> None:
        """Close the pidfds of the ranks still running (the supervisor is done)."""
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()


class Replacements:
    """An elastic job's replacements of failed ranks (``ferrodist run -n MIN:MAX``): one is
    started for each rank that fails while the job may go on (as many as there are ranks,
    in all; none once a rank, here or on another node, has finished), and those still waiting to join when every
    other rank has finished are stopped ``grace`` seconds later (nobody is left to take
    them in); they do not count as failures."""

    def __init__(self, start: Callable[[int], subprocess.Popen[bytes]], budget: int, grace: float) -> None:
        self.start, self.budget, self.grace = start, budget, grace
        self.running: set[int] = set()  # ranks whose process is a replacement
        self.abandoned: set[int] = set()
        self._alone_since: float | None = None

    def after_failures(self, watch: Watch, new: list[int]) -> list[int]:
        """Start replacements for the ranks in ``new`` that failed; those it started."""
        if any(watch.procs[r].returncode == 0 for r in watch.exited) or (
            watch.link is not None and watch.link.finished
        ):
            return []  # the job is finishing: no group is left to take a replacement in
        started = []
        for local in new:
            if self.budget > 0:
                self.budget -= 1
                watch.restart(local, self.start(local))
                self.running.add(local)
                started.append(local)
        return started

    def deadline(self, watch: Watch) -> float | None:
        """When to stop the replacements left waiting, if only they are left (else None): this
        node's other ranks have exited, and some of them, or another node's, finished."""
        others = [r for r in range(len(watch.procs)) if r not in self.running]
        elsewhere = watch.link is not None and bool(watch.link.finished)
        finished = all(r in watch.exited for r in others) and (
            elsewhere or any(watch.procs[r].returncode == 0 for r in others)
        )
        waiting = [r for r in self.running if r not in watch.exited]
        if not (finished and waiting):
            self._alone_since = None
            return None
        if self._alone_since is None:
            self._alone_since = time.monotonic()
        return self._alone_since + self.grace

    def abandon(self, watch: Watch) -> None:
        """Stop the replacements still waiting: the job finished without them."""
        for local in self.running:
            if local not in watch.exited:
                self.abandoned.add(local)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(watch.procs[local].pid, signal.SIGKILL)
                watch.procs[local].wait(10)
        watch.wait(time.monotonic())


def supervise(
    watch: Watch,
    grace: float,
    first: int = 0,
    console: Console | None = None,
    tolerate: int = 0,
    replacements: Replacements | None = None,
) -> int | None:
    """Wait for the ranks, stop them after a failure (more than ``tolerate``; those of
    ``replacements`` are replaced), a signal or (several nodes) another node's failure, and
    reap them all. Returns the signal the launcher received first, if that is what stopped
    the job. ``first``: the global rank of local rank 0."""
    interrupted = None
    link = watch.link
    try:
        while watch.running() and watch.failures() <= tolerate:
            failed = set(watch.failed())
            until = replacements.deadline(watch) if replacements is not None else None
            if until is not None and time.monotonic() >= until:
                replacements.abandon(watch)  # type: ignore[union-attr]
                continue
            interrupted = watch.wait(until)
            if interrupted is not None or (link is not None and link.remote_stop is not None):
                break
            new = [local for local in watch.failed() if local not in failed]
            if new and watch.failures() <= tolerate and console is not None:
                lost = [first + r for r in watch.failed()]
                left = len(watch.procs) - len(lost)
                said = f"ferrodist run: ranks {lost} failed; the other {left} go on (at least {len(watch.procs) - tolerate} must)"
                for local in replacements.after_failures(watch, new) if replacements is not None else ():
                    said += f"; rank {first + local}'s replacement starts (it joins at the others' next commit)"
                console.line(said)
        if link is not None:
            if interrupted is not None:
                link.report(f"its launcher was interrupted by {signal_name(interrupted)}", interrupted)
            elif watch.failures() > tolerate:
                local = next(r for r in watch.exited if watch.procs[r].returncode != 0)
                link.report(f"rank {first + local} {describe(int(watch.procs[local].returncode or 0))}")
            elif link.remote_stop is not None and watch.running() and console is not None:
                console.line(f"ferrodist run: node {link.node} stops its ranks: {link.remote_stop}")
        # After a failure: SIGTERM; after a signal: that signal; after success: SIGTERM to
        # what the ranks left in their process groups. SIGKILL after the grace period.
        watch.send(interrupted or signal.SIGTERM)
        deadline = time.monotonic() + grace
        while (watch.running() or watch.groups_alive()) and time.monotonic() < deadline:
            if watch.wait(min(deadline, time.monotonic() + 0.05)) is not None:
                break  # signalled again: no more waiting
        watch.send(signal.SIGKILL)
        for proc in watch.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        watch.wait(time.monotonic())
    finally:
        watch.close()
    return interrupted


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the process group of every rank that is still running, and reap it."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
