"""Start N ranks, label their output, tear the job down as soon as one rank fails, and name
the rank to blame.

Ranks never outlive the launcher: each one gets Linux's ``PR_SET_PDEATHSIG`` (SIGKILL), so
the kernel kills it when the launcher dies, even of SIGKILL. SIGINT, SIGTERM and SIGHUP
sent to the launcher go to every rank, and the ranks still running ``grace`` seconds later
get SIGKILL. ``_verdict`` turns how the ranks ended into the summary line, ``_output``
labels the ranks' output, and ``_nodes`` connects the launchers of a job that spans nodes.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

from ._nodes.hub import Hub
from ._nodes.link import DEFAULT_JOIN_TIMEOUT, DEFAULT_SILENCE, HEARTBEAT, NodeFailure
from ._nodes.member import Member
from ._nodes.placement import Placement
from ._output import Console
from ._output import pump as _pump
from ._spawn import die_with, start_rank
from ._verdict import RankEnd, describe, diagnose, read_error, signal_name

__all__ = ["DEFAULT_GRACE", "DEFAULT_JOIN_TIMEOUT", "DEFAULT_NODES_PORT", "JobResult", "run"]

#: Seconds between the signal that asks the ranks to stop and SIGKILL.
DEFAULT_GRACE = 3.0
#: Where node 0's launcher listens for the others' when ``--master-port`` is not given (torchrun's default).
DEFAULT_NODES_PORT = 29500
_MEMBER_EXTRA = 10.0  # a member waits this much longer than node 0 for the start: node 0 says why it failed
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class JobResult:
    """How a job ended.

    Attributes:
        exit_code: what ``ferrodist run`` exits with: 0; the exit code of the rank the
            failure is blamed on (128 + the signal that killed it); or, when that rank was
            frozen and stopped by the launcher, the first failing rank's. 128 + the signal
            when a launcher was interrupted; 1 when a node was lost or never arrived.
        failed_rank: the rank the failure is blamed on (the root cause), or ``None``.
        returncodes: the return code of every rank this launcher started, by local rank
            (negative: killed by that signal).
        stopped: the ranks this launcher signalled while they were still running.
        summary: the line the launcher printed (empty when every rank succeeded).
        failed_node: in a job of several nodes, the node of the rank to blame, or the node
            that was lost or never arrived; else ``None``.
    """

    exit_code: int
    failed_rank: int | None
    returncodes: tuple[int, ...]
    stopped: tuple[int, ...] = ()
    summary: str = ""
    failed_node: int | None = None


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def run(
    nprocs: int,
    command: Sequence[str],
    *,
    module: bool = False,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    grace: float = DEFAULT_GRACE,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    log_dir: str | None = None,
    out: BinaryIO | None = None,
    extra_env: dict[str, str] | None = None,
    silence: float = DEFAULT_SILENCE,
    max_restarts: int = 0,
) -> JobResult:
    """Run ``command`` as ``nprocs`` ranks on this machine and wait for them.

    With several ranks on this node and no ``OMP_NUM_THREADS`` set, every rank gets
    ``OMP_NUM_THREADS=1`` (as torchrun does), and the launcher says so once.

    Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK`` and ``NODE_RANK`` (this node), ``GROUP_WORLD_SIZE`` (``nnodes``),
    ``MASTER_ADDR``, ``MASTER_PORT``, a ``FERRODIST_TOKEN`` (random per job), a job id
    ``FERRODIST_JOB_ID`` (shared-memory files of the job are removed at the end) and a
    ``FERRODIST_ERROR_FILE`` where ferrodist records the rank's first error; a command
    that is a ``.py`` file runs under this Python, and with ``module=True`` the command is
    a module and its arguments (``python -m``). Every line, or ``\\r`` segment, a rank
    prints is prefixed with ``[rank k]``, and with ``log_dir`` also copied as it is to
    ``log_dir/rank-k.log``. When a rank exits non-zero or dies, the others get SIGTERM, then
    SIGKILL after ``grace`` seconds; SIGINT, SIGTERM and SIGHUP sent to the launcher (from the
    main thread) are passed to the ranks, with SIGKILL after ``grace`` seconds too, or at
    once on a second signal. The summary names the root cause (see ``_verdict``).

    With ``nnodes`` > 1, one launcher runs on each node (``node_rank`` 0 to ``nnodes`` - 1,
    all with the same ``master_addr``, node 0's address, and ``master_port``, where node 0's
    launcher listens for the others) and node ``k``'s ranks follow those of nodes ``0 .. k-1``;
    nodes may run different numbers of ranks. Every node needs the same ``FERRODIST_TOKEN``
    in its environment. A failure on any node, or a launcher lost, stops every node's ranks
    (see ``_nodes``); every launcher prints the same summary and returns the same exit code.

    ``max_restarts``: when a rank fails or a node's launcher is lost (on any node), start
    the whole job again, with a new rendezvous (port, token, job id), up to this many times.
    Every launcher of the job must be given the same number; each restart tells the ranks
    which one it is in ``FERRODIST_RESTART_COUNT`` (and ``TORCHELASTIC_RESTART_COUNT``, as
    torchrun does), so a script resumes from its last checkpoint
    (``ferrodist.ddp.resume_checkpoint``). After a lost node the others wait up to
    ``join_timeout`` for a launcher started again with that ``node_rank`` (it joins the
    restart in progress). A launcher interrupted by a signal, or a node that never arrived,
    ends the job without a restart.

    Call it from a thread that lives until it returns: the ranks die with the thread that
    started them (``PR_SET_PDEATHSIG``).

    Example:
        >>> result = run(2, ["train.py", "--epochs", "1"])  # output: [rank 0] ..., [rank 1] ...
        >>> result.exit_code, result.failed_rank
        (0, None)
    """
    _check(nprocs, command, nnodes, node_rank, grace, join_timeout)
    if not (isinstance(max_restarts, int) and max_restarts >= 0):
        raise _invalid(f"ferrodist run: --max-restarts must be a whole number >= 0, not {max_restarts!r}")
    argv = list(command)
    if module:
        argv = [sys.executable, "-u", "-m", *argv]
    elif argv[0].endswith(".py"):
        argv = [sys.executable, "-u", *argv]
    if log_dir is not None:
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as exc:
            raise _invalid(f"ferrodist run: --log-dir {log_dir!r}: cannot make it ({exc.strerror})") from None
    sink = out if out is not None else sys.stdout.buffer
    console = Console.of(sink)
    token = os.environ.get("FERRODIST_TOKEN", "")
    if nnodes > 1 and not token:
        raise _invalid(
            f"ferrodist run: a job of {nnodes} nodes needs the same FERRODIST_TOKEN on every node, so that its "
            "launchers and ranks accept only each other: make one with "
            "`export FERRODIST_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')` and export that "
            "value on every node before `ferrodist run`"
        )
    if nprocs > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in (extra_env or {}):
        # Each rank's OpenMP pool (torch's, numpy's BLAS) would otherwise start a thread per
        # core, and the ranks of a host would fight over the cores: steps many times slower.
        extra_env = {**(extra_env or {}), "OMP_NUM_THREADS": "1"}
        print(
            f"ferrodist run: OMP_NUM_THREADS=1 for each of the {nprocs} ranks on this host (their thread pools "
            "would otherwise share the cores); set OMP_NUM_THREADS to choose another number",
            file=sys.stderr,
            flush=True,
        )
    signals = _Signals()  # before the first rank starts: a signal from now on stops the job
    try:
        restart = 0
        while True:
            where = _Where(nprocs, nnodes, node_rank, master_addr, master_port, token, join_timeout, silence)
            result, restart, started = _attempt(where, argv, console, signals, grace, log_dir, extra_env, restart)
            lost = started and result.failed_rank is None and result.failed_node is not None
            failed = result.failed_rank is not None or lost
            if result.exit_code == 0 or not failed or restart >= max_restarts or signals.seen:
                if failed and max_restarts and restart >= max_restarts and not signals.seen:
                    console.line(
                        f"ferrodist run: no restart left ({max_restarts} of {max_restarts} used): the job ends"
                    )
                return result
            restart += 1
            wait = f"; waiting up to {join_timeout:g} s for node {result.failed_node}'s launcher" if lost else ""
            console.line(
                f"ferrodist run: restarting the job ({restart} of {max_restarts} restarts): every rank starts "
                f"again with a new rendezvous{wait}"
            )
    finally:
        signals.close()


class _Where(NamedTuple):
    """This launcher's part of the job, as its command line says."""

    nprocs: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    token: str
    join_timeout: float
    silence: float


def _attempt(
    where: _Where,
    argv: list[str],
    console: Console,
    signals: _Signals,
    grace: float,
    log_dir: str | None,
    extra_env: dict[str, str] | None,
    attempt: int,
) -> tuple[JobResult, int, bool]:
    """Start ``attempt`` of the job: place this node's ranks (alone, or meeting the other
    nodes' launchers; a member takes node 0's attempt number, as a launcher that replaces a
    lost node must), run them; the verdict, the attempt it was, and whether the ranks ran."""
    link: Hub | Member | None = None
    try:
        if where.nnodes == 1:
            placement = Placement(
                0,
                1,
                0,
                where.nprocs,
                where.nprocs,
                where.master_addr,
                where.master_port or free_port(where.master_addr),
                secrets.token_hex(32),
                secrets.token_hex(6),  # names the job's shared-memory files, so they can be removed
                attempt=attempt,
            )
        else:
            try:
                link, placement = _join(where, signals.fd, attempt)
            except NodeFailure as failure:
                console.line(failure.summary)
                return JobResult(failure.exit_code, None, (), (), failure.summary, failure.node), attempt, False
        count = str(placement.attempt)
        env = dict(extra_env or {}, FERRODIST_RESTART_COUNT=count, TORCHELASTIC_RESTART_COUNT=count)
        return _run_ranks(placement, argv, console, signals, link, grace, log_dir, env), placement.attempt, True
    finally:
        if link is not None:
            link.close()


def _check(nprocs: int, command: Sequence[str], nnodes: int, node_rank: int, grace: float, join: float) -> None:
    if nprocs < 1:
        raise _invalid(f"ferrodist run: -n must be at least 1, not {nprocs}")
    if not command:
        raise _invalid("ferrodist run: give the script (or command) to run")
    if not (isinstance(grace, (int, float)) and math.isfinite(grace) and grace >= 0):
        raise _invalid(f"ferrodist run: --grace must be a number of seconds >= 0, not {grace!r}")
    if nnodes < 1:
        raise _invalid(f"ferrodist run: --nnodes must be at least 1, not {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise _invalid(
            f"ferrodist run: --node-rank {node_rank} is not a node of a job of --nnodes {nnodes} "
            f"(give each node's launcher one of 0 to {nnodes - 1})"
        )
    if not (isinstance(join, (int, float)) and math.isfinite(join) and join > 0):
        raise _invalid(f"ferrodist run: --join-timeout must be a number of seconds > 0, not {join!r}")


def _join(where: _Where, stop_fd: int, attempt: int = 0) -> tuple[Hub | Member, Placement]:
    """Meet the other nodes' launchers (see ``_nodes``): this node's link and placement."""
    nprocs, nnodes, node_rank, master_addr, master_port, token, join_timeout, silence = where
    port = master_port or DEFAULT_NODES_PORT
    deadline = time.monotonic() + join_timeout
    if node_rank == 0:
        hub = Hub(master_addr, port, nnodes=nnodes, nprocs=nprocs, token=token, silence=silence)
        try:
            return hub, hub.gather(deadline, stop_fd, attempt)
        except BaseException:
            hub.close()
            raise
    member = Member(node_rank, nnodes=nnodes, nprocs=nprocs, token=token, silence=silence)
    try:
        return member, member.join(master_addr, port, deadline + _MEMBER_EXTRA, stop_fd)
    except BaseException:
        member.close()
        raise


def _run_ranks(
    placement: Placement,
    argv: list[str],
    console: Console,
    signals: _Signals,
    link: Hub | Member | None,
    grace: float,
    log_dir: str | None,
    extra_env: dict[str, str] | None,
) -> JobResult:
    """Start this node's ranks, supervise them, and return the verdict on the job."""
    first = placement.first_rank
    errors = tempfile.mkdtemp(prefix="ferrodist-run-")
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    logs: list[BinaryIO | None] = []
    setup = die_with(os.getpid())
    watch: _Watch | None = None
    try:
        for local in range(placement.local_size):
            rank = first + local
            logs.append(open(os.path.join(log_dir, f"rank-{rank}.log"), "wb") if log_dir is not None else None)
            env = dict(os.environ)
            env.update(extra_env or {})
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(placement.world_size),
                LOCAL_RANK=str(local),
                LOCAL_WORLD_SIZE=str(placement.local_size),
                GROUP_RANK=str(placement.node_rank),
                NODE_RANK=str(placement.node_rank),
                GROUP_WORLD_SIZE=str(placement.nnodes),
                MASTER_ADDR=placement.master_addr,
                MASTER_PORT=str(placement.master_port),
                FERRODIST_TOKEN=placement.token,
                FERRODIST_JOB_ID=placement.job,
                FERRODIST_ERROR_FILE=os.path.join(errors, f"rank{rank}.json"),
                PYTHONUNBUFFERED="1",
            )
            env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash prints every thread's Python stack
            try:
                procs.append(start_rank(argv, env, setup))
            except OSError as exc:
                if link is not None:
                    link.report(f"its launcher could not start {argv[0]!r} ({exc.strerror})")
                raise _invalid(f"ferrodist run: cannot start {argv[0]!r}: {exc.strerror}") from None
        # After the forks: no thread of ours runs during one.
        for local, proc in enumerate(procs):
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(proc.stdout, first + local, console, logs[local]), daemon=True)
            pump.start()
            pumps.append(pump)
        if link is not None:
            link.start_heartbeats()
        watch = _Watch(procs, signals, link)
        interrupted = _supervise(watch, grace, first, console)
        ends = [
            RankEnd(
                first + local,
                -signal.SIGKILL if proc.returncode is None else int(proc.returncode),  # None: stuck in the kernel
                watch.order(local),
                watch.stopped.get(local),
                read_error(os.path.join(errors, f"rank{first + local}.json")),
            )
            for local, proc in enumerate(procs)
        ]
    finally:
        _kill_all(procs)  # nothing to do unless this failed half-way
        remove_shared_memory(placement.job)
        shutil.rmtree(errors, ignore_errors=True)
        for log in logs[len(pumps) :]:
            if log is not None:
                log.close()
    for pump in pumps:
        pump.join(5)
    stopped = tuple(sorted(first + local for local in watch.stopped))
    returncodes = tuple(end.code for end in ends)
    if link is None:
        verdict = diagnose(ends, interrupted=interrupted)
        if verdict.summary:
            console.line(verdict.summary)
        return JobResult(
            verdict.exit_code, verdict.culprits[0] if verdict.culprits else None, returncodes, stopped, verdict.summary
        )
    times = {first + local: at - watch.started for local, at in watch.exited_at.items()}
    outcome = link.finish(ends, times, interrupted, signals.fd, grace + 30 + link.silence)
    if outcome.summary:
        console.line(outcome.summary)
    return JobResult(outcome.exit_code, outcome.failed_rank, returncodes, stopped, outcome.summary, outcome.failed_node)


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


class _Watch:
    """The ranks as the supervisor sees them: the order they exit in (from their pidfds, or
    polling every 50 ms where there are none), and the signal it first sent each rank
    that was still running."""

    def __init__(
        self, procs: list[subprocess.Popen[bytes]], signals: _Signals, link: Hub | Member | None = None
    ) -> None:
        self.procs = procs
        self.signals = signals
        self.link = link
        self.started = time.monotonic()
        self.exited: list[int] = []
        self.exited_at: dict[int, float] = {}
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
            links = self.link.fds() if self.link is not None else []
            if self.link is not None:
                timeout = min(timeout, HEARTBEAT)
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


def _supervise(watch: _Watch, grace: float, first: int = 0, console: Console | None = None) -> int | None:
    """Wait for the ranks, stop them after a failure, a signal or (several nodes) another
    node's failure, and reap them all. Returns the signal the launcher received first, if
    that is what stopped the job. ``first``: the global rank of local rank 0."""
    interrupted = None
    link = watch.link
    try:
        while watch.running() and not watch.failed():
            interrupted = watch.wait(None)
            if interrupted is not None or (link is not None and link.remote_stop is not None):
                break
        if link is not None:
            if interrupted is not None:
                link.report(f"its launcher was interrupted by {signal_name(interrupted)}", interrupted)
            elif watch.failed():
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


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the process group of every rank that is still running, and reap it."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
