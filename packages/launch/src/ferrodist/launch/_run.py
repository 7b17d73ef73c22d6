"""Start N ranks, label their output, and tear the job down as soon as one rank fails."""

from __future__ import annotations

import glob
import importlib
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["JobResult", "run"]


@dataclass(frozen=True)
class JobResult:
    """How a job ended.

    Attributes:
        exit_code: what ``ferrodist run`` exits with: 0, the first failing rank's exit code,
            or 128 + the signal that killed it.
        failed_rank: the first rank that failed, or ``None``.
        returncodes: every rank's return code (negative: killed by that signal).
    """

    exit_code: int
    failed_rank: int | None
    returncodes: tuple[int, ...]


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run(
    nprocs: int,
    command: Sequence[str],
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    grace: float = 3.0,
    out: BinaryIO | None = None,
    extra_env: dict[str, str] | None = None,
) -> JobResult:
    """Run ``command`` as ``nprocs`` ranks on this machine and wait for them.

    Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``, a fresh random ``FERRODIST_TOKEN`` and a job id
    ``FERRODIST_JOB_ID`` (shared-memory files of the job are removed at the end); a command
    that is a ``.py`` file runs under this Python. Every output line is prefixed with
    ``[rank k]``. When a rank exits non-zero or dies, the others get SIGTERM, then
    SIGKILL after ``grace`` seconds, and the result names the first rank that failed.
    """
    if nprocs < 1:
        raise _invalid(f"ferrodist run: -n must be at least 1, not {nprocs}")
    if not command:
        raise _invalid("ferrodist run: give the script (or command) to run")
    argv = list(command)
    if argv[0].endswith(".py"):
        argv = [sys.executable, "-u", *argv]
    sink = out if out is not None else sys.stdout.buffer
    port = master_port or free_port(master_addr)
    token = secrets.token_hex(32)
    job = secrets.token_hex(6)  # names the job's shared-memory files, so they can be removed
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
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
            PYTHONUNBUFFERED="1",
        )
        try:
            proc = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as exc:
            _terminate(procs, grace)
            raise _invalid(f"ferrodist run: cannot start {argv[0]!r}: {exc.strerror}") from None
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc, rank, sink, lock), daemon=True)
        pump.start()
        pumps.append(pump)

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            _signal(proc, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, forward)
    try:
        failed = _watch(procs)
        _terminate(procs, grace)  # after a failure: the other ranks; after success: any leftovers
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        remove_shared_memory(job)
    for pump in pumps:
        pump.join(5)
    codes = tuple(int(p.returncode) for p in procs)
    if failed is None:
        return JobResult(0, None, codes)
    code = codes[failed]
    exit_code = code if code > 0 else 128 + (-code if code < 0 else 1)
    others = [r for r in range(nprocs) if r != failed and codes[r] != 0]
    summary = f"ferrodist run: rank {failed} {_describe(code)}"
    summary += f"; stopped ranks {others}" if others else ""
    with lock:
        sink.write(summary.encode() + b"\n")
        sink.flush()
    return JobResult(exit_code, failed, codes)


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


def _watch(procs: list[subprocess.Popen[bytes]]) -> int | None:
    """Wait until every rank has exited (None) or one has failed (its rank).

    Sleeps on the ranks' pidfds (woken the moment one exits); polls every 50 ms where the
    system has none."""
    try:
        fds = {os.pidfd_open(proc.pid): proc for proc in procs}
    except (AttributeError, OSError):
        fds = {}
    try:
        while fds:
            ready, _, _ = select.select(list(fds), [], [], 1.0)
            for fd in ready:
                proc = fds.pop(fd)
                os.close(fd)
                if proc.wait() != 0:
                    return procs.index(proc)
        if all(proc.poll() == 0 for proc in procs):
            return None
    finally:
        for fd in fds:
            os.close(fd)
    while True:
        running = False
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0:
                return rank
        if not running:
            return None
        time.sleep(0.05)


def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # the rank and anything it started
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every rank's process group (a rank that already exited may have left
    children there), then SIGKILL what is still alive after ``grace`` seconds."""
    for proc in procs:
        _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    while time.monotonic() < deadline and any(_group_alive(p) for p in procs):
        time.sleep(0.05)
    for proc in procs:
        _signal(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    try:
        os.killpg(proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _pump(proc: subprocess.Popen[bytes], rank: int, sink: BinaryIO, lock: threading.Lock) -> None:
    prefix = f"[rank {rank}] ".encode()
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        with lock:
            sink.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
            sink.flush()
    proc.stdout.close()
