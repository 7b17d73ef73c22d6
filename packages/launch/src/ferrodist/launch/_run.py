"""Start N ranks, label their output, tear the job down as soon as one rank fails, and name
the rank to blame.

Ranks never outlive the launcher: each one gets Linux's ``PR_SET_PDEATHSIG`` (SIGKILL), so
the kernel kills it when the launcher dies, even of SIGKILL. SIGINT, SIGTERM and SIGHUP
sent to the launcher go to every rank, and the ranks still running ``grace`` seconds later
get SIGKILL. ``_verdict`` turns how the ranks ended into the summary line.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib
import math
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from ._verdict import RankEnd, diagnose, read_error

__all__ = ["DEFAULT_GRACE", "JobResult", "run"]

#: Seconds between the signal that asks the ranks to stop and SIGKILL.
DEFAULT_GRACE = 3.0
_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class JobResult:
    """How a job ended.

    Attributes:
        exit_code: what ``ferrodist run`` exits with: 0; the exit code of the rank the
            failure is blamed on (128 + the signal that killed it); or, when that rank was
            frozen and stopped by the launcher, the first failing rank's. 128 + the signal
            when the launcher itself was interrupted.
        failed_rank: the rank the failure is blamed on (the root cause), or ``None``.
        returncodes: every rank's return code (negative: killed by that signal).
        stopped: the ranks the launcher signalled while they were still running.
        summary: the line the launcher printed (empty when every rank succeeded).
    """

    exit_code: int
    failed_rank: int | None
    returncodes: tuple[int, ...]
    stopped: tuple[int, ...] = ()
    summary: str = ""


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def run(
    nprocs: int,
    command: Sequence[str],
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    grace: float = DEFAULT_GRACE,
    out: BinaryIO | None = None,
    extra_env: dict[str, str] | None = None,
) -> JobResult:
    """Run ``command`` as ``nprocs`` ranks on this machine and wait for them.

    Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``, a fresh random ``FERRODIST_TOKEN``, a job id
    ``FERRODIST_JOB_ID`` (shared-memory files of the job are removed at the end) and a
    ``FERRODIST_ERROR_FILE`` where ferrodist records the rank's first error; a command
    that is a ``.py`` file runs under this Python. Every output line is prefixed with
    ``[rank k]``. When a rank exits non-zero or dies, the others get SIGTERM, then SIGKILL
    after ``grace`` seconds; SIGINT, SIGTERM and SIGHUP sent to the launcher (from the main
    thread) are passed to the ranks, with SIGKILL after ``grace`` seconds too, or at once
    on a second signal. The summary names the root cause (see ``_verdict``).

    Call it from a thread that lives until it returns: the ranks die with the thread that
    started them (``PR_SET_PDEATHSIG``).

    Example:
        >>> result = run(2, ["train.py", "--epochs", "1"])  # output: [rank 0] ..., [rank 1] ...
        >>> result.exit_code, result.failed_rank
        (0, None)
    """
    if nprocs < 1:
        raise _invalid(f"ferrodist run: -n must be at least 1, not {nprocs}")
    if not command:
        raise _invalid("ferrodist run: give the script (or command) to run")
    if not (isinstance(grace, (int, float)) and math.isfinite(grace) and grace >= 0):
        raise _invalid(f"ferrodist run: --grace must be a number of seconds >= 0, not {grace!r}")
    argv = list(command)
    if argv[0].endswith(".py"):
        argv = [sys.executable, "-u", *argv]
    sink = out if out is not None else sys.stdout.buffer
    port = master_port or free_port(master_addr)
    token = secrets.token_hex(32)
    job = secrets.token_hex(6)  # names the job's shared-memory files, so they can be removed
    errors = tempfile.mkdtemp(prefix="ferrodist-run-")
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    setup = _die_with(os.getpid())
    signals = _Signals()  # before the first rank starts: a signal from now on stops the job
    try:
        for rank in range(nprocs):
            env = dict(os.environ)
            env.update(extra_env or {})
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(nprocs),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(nprocs),
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(port),
                FERRODIST_TOKEN=token,
                FERRODIST_JOB_ID=job,
                FERRODIST_ERROR_FILE=os.path.join(errors, f"rank{rank}.json"),
                PYTHONUNBUFFERED="1",
            )
            try:
                procs.append(_start(argv, env, setup))
            except OSError as exc:
                raise _invalid(f"ferrodist run: cannot start {argv[0]!r}: {exc.strerror}") from None
        for rank, proc in enumerate(procs):  # after the forks: no thread of ours runs during one
            pump = threading.Thread(target=_pump, args=(proc, rank, sink, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        watch = _Watch(procs, signals)
        interrupted = _supervise(watch, grace)
        ends = [
            RankEnd(
                rank,
                -signal.SIGKILL if proc.returncode is None else int(proc.returncode),  # None: stuck in the kernel
                watch.order(rank),
                watch.stopped.get(rank),
                read_error(os.path.join(errors, f"rank{rank}.json")),
            )
            for rank, proc in enumerate(procs)
        ]
    finally:
        signals.close()
        _kill_all(procs)  # nothing to do unless this failed half-way
        remove_shared_memory(job)
        shutil.rmtree(errors, ignore_errors=True)
    for pump in pumps:
        pump.join(5)
    verdict = diagnose(ends, interrupted=interrupted)
    if verdict.summary:
        with lock:
            sink.write(verdict.summary.encode() + b"\n")
            sink.flush()
    return JobResult(
        verdict.exit_code,
        verdict.culprits[0] if verdict.culprits else None,
        tuple(end.code for end in ends),
        tuple(sorted(watch.stopped)),
        verdict.summary,
    )


def remove_shared_memory(job: str, directory: str = "/dev/shm") -> list[str]:
    """Remove the shared-memory files of ``job`` (ranks unlink them once every rank has
    them mapped; this catches a job that died before that). Returns what was removed."""
    removed = []
    for path in glob.glob(os.path.join(directory, f"ferrodist-{job}-*")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _invalid(message: str) -> Exception:
    """``InvalidArgument(message)``; ferrodist.core (numpy) is imported only on this error path,
    so that starting the ranks does not wait for it."""
    errors = importlib.import_module("ferrodist.core")
    return errors.InvalidArgument(message)  # type: ignore[no-any-return]


def _start(argv: list[str], env: dict[str, str], setup: Callable[[], None] | None) -> subprocess.Popen[bytes]:
    """One rank, in its own process group, running ``setup`` (``_die_with``) before exec."""
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=setup
    )


def _die_with(launcher: int) -> Callable[[], None] | None:
    """What a rank runs between fork and exec so the kernel kills it with SIGKILL when the
    launcher dies (``PR_SET_PDEATHSIG``); ``None`` where the system has no such thing.

    A launcher that died between the fork and the ``prctl`` would go unnoticed, so the rank
    then checks that its parent is still the launcher."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    option, sigkill, zero = ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0)

    def die_with_launcher() -> None:
        prctl(option, sigkill, zero, zero, zero)
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGKILL)

    return die_with_launcher


class _Signals:
    """SIGINT, SIGTERM and SIGHUP sent to the launcher, queued on a pipe the supervisor
    sleeps on. Handlers can only be installed from the main thread; elsewhere none are."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in _FORWARDED:
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
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


class _Watch:
    """The ranks as the supervisor sees them: the order they exit in (from their pidfds, or
    polling every 50 ms where there are none), and the signal it first sent each rank
    that was still running."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], signals: _Signals) -> None:
        self.procs = procs
        self.signals = signals
        self.exited: list[int] = []
        self.stopped: dict[int, int] = {}
        self._pidfds: dict[int, int] = {}  # rank -> pidfd, while it runs
        for rank, proc in enumerate(procs):
            try:
                self._pidfds[rank] = os.pidfd_open(proc.pid)
            except (AttributeError, OSError):
                break
        else:
            return
        self.close()  # some but not all: poll them all

    def order(self, rank: int) -> int:
        return self.exited.index(rank) if rank in self.exited else len(self.exited)

    def running(self) -> list[int]:
        return [rank for rank in range(len(self.procs)) if rank not in self.exited]

    def failed(self) -> bool:
        return any(self.procs[rank].returncode != 0 for rank in self.exited)

    def wait(self, deadline: float | None) -> int | None:
        """Sleep until a rank exits, a signal arrives, or ``deadline`` (monotonic) passes;
        returns the signal, if one arrived."""
        signum = self.signals.take()
        if signum is None and not self._reap():
            polling = not self._pidfds and bool(self.running())
            timeout = 0.05 if polling else 1.0
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.monotonic()))
            select.select([self.signals.fd, *self._pidfds.values()], [], [], timeout)
            signum = self.signals.take()
        self._reap()
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


def _supervise(watch: _Watch, grace: float) -> int | None:
    """Wait for the ranks, stop them after a failure or a signal, and reap them all.
    Returns the signal the launcher received first, if that is what stopped the job."""
    interrupted = None
    try:
        while watch.running() and not watch.failed():
            interrupted = watch.wait(None)
            if interrupted is not None:
                break
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


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the process group of every rank that is still running, and reap it."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def _pump(proc: subprocess.Popen[bytes], rank: int, sink: BinaryIO, lock: threading.Lock) -> None:
    prefix = f"[rank {rank}] ".encode()
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        with lock:
            sink.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
            sink.flush()
    proc.stdout.close()
