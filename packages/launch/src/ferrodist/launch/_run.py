"""Start N ranks, label their output, tear the job down as soon as one rank fails (or, in an
elastic job, once too few are left), and name the rank to blame.

Ranks never outlive the launcher: each one gets Linux's ``PR_SET_PDEATHSIG`` (SIGKILL), so
the kernel kills it when the launcher dies, even of SIGKILL. SIGINT, SIGTERM and SIGHUP
sent to the launcher go to every rank, and the ranks still running ``grace`` seconds later
get SIGKILL. ``_supervise`` watches the ranks, ``_verdict`` turns how they ended into the
summary line, ``_output`` labels their output, and ``_nodes`` connects the launchers of a
job that spans nodes.
"""

from __future__ import annotations

import glob
import importlib
import math
import os
import secrets
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
from typing import BinaryIO, NamedTuple

from ._nodes.hub import Hub
from ._nodes.link import DEFAULT_JOIN_TIMEOUT, DEFAULT_SILENCE, NodeFailure
from ._nodes.member import Member
from ._nodes.placement import Placement
from ._output import Console
from ._output import pump as _pump
from ._spawn import die_with, start_rank
from ._supervise import Replacements, Signals, Watch, kill_all, supervise
from ._verdict import RankEnd, diagnose, finished_without, read_error

__all__ = ["DEFAULT_GRACE", "DEFAULT_JOIN_TIMEOUT", "DEFAULT_NODES_PORT", "JobResult", "run"]

#: Where an elastic job's replacements of lost ranks say where they listen (the variable
#: ``ferrodist.collectives`` reads; a replacement also gets ``FERRODIST_JOIN=1``).
JOIN_DIR = "FERRODIST_JOIN_DIR"
#: Seconds between the signal that asks the ranks to stop and SIGKILL.
DEFAULT_GRACE = 3.0
#: Where node 0's launcher listens for the others' when ``--master-port`` is not given (torchrun's default).
DEFAULT_NODES_PORT = 29500
_MEMBER_EXTRA = 10.0  # a member waits this much longer than node 0 for the start: node 0 says why it failed


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
    min_ranks: int | None = None,
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

    ``min_ranks`` (``ferrodist run -n MIN:MAX``, per node): a rank that fails does not stop the
    others while at least ``min_ranks`` of this node's ranks have not failed (their script
    shrinks its group and goes on: ``ferrodist.elastic``), and a replacement starts in its
    place (it joins the group at a commit point); the job succeeds if the ranks it ends with
    all succeed. With several nodes each launcher keeps its node's count, and the nodes share
    their replacements' word (``_nodes.joins``); a node that falls below ``min_ranks``, or is
    lost, stops the job on every node as a failure does in a job that is not elastic.

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
    if min_ranks is not None and not (isinstance(min_ranks, int) and 1 <= min_ranks <= nprocs):
        raise _invalid(f"ferrodist run: -n MIN:MAX needs 1 <= MIN <= MAX, not MIN={min_ranks!r}, MAX={nprocs}")
    tolerate = 0 if min_ranks is None else nprocs - min_ranks
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
    signals = Signals()  # before the first rank starts: a signal from now on stops the job
    try:
        restart = 0
        while True:
            where = _Where(
                nprocs, nnodes, node_rank, master_addr, master_port, token, join_timeout, silence, tolerate > 0
            )
            result, restart, started = _attempt(
                where, argv, console, signals, grace, log_dir, extra_env, restart, tolerate
            )
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
    elastic: bool = False  # -n MIN:MAX


def _attempt(
    where: _Where,
    argv: list[str],
    console: Console,
    signals: Signals,
    grace: float,
    log_dir: str | None,
    extra_env: dict[str, str] | None,
    attempt: int,
    tolerate: int = 0,
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
        ran = _run_ranks(placement, argv, console, signals, link, grace, log_dir, env, tolerate)
        return ran, placement.attempt, True
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
    nprocs, nnodes, node_rank, master_addr, master_port, token, join_timeout, silence, elastic = where
    port = master_port or DEFAULT_NODES_PORT
    deadline = time.monotonic() + join_timeout
    if node_rank == 0:
        hub = Hub(master_addr, port, nnodes=nnodes, nprocs=nprocs, token=token, silence=silence, elastic=elastic)
        try:
            return hub, hub.gather(deadline, stop_fd, attempt)
        except BaseException:
            hub.close()
            raise
    member = Member(node_rank, nnodes=nnodes, nprocs=nprocs, token=token, silence=silence, elastic=elastic)
    try:
        return member, member.join(master_addr, port, deadline + _MEMBER_EXTRA, stop_fd)
    except BaseException:
        member.close()
        raise


def _run_ranks(
    placement: Placement,
    argv: list[str],
    console: Console,
    signals: Signals,
    link: Hub | Member | None,
    grace: float,
    log_dir: str | None,
    extra_env: dict[str, str] | None,
    tolerate: int = 0,
) -> JobResult:
    """Start this node's ranks, supervise them (up to ``tolerate`` of them may fail while the
    others go on), and return the verdict on the job."""
    first = placement.first_rank
    errors = tempfile.mkdtemp(prefix="ferrodist-run-")
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    logs: list[BinaryIO | None] = []
    setup = die_with(os.getpid())
    watch: Watch | None = None
    envs: list[dict[str, str]] = []
    joins = {JOIN_DIR: os.path.join(errors, "join")} if tolerate else {}  # replacements say where they listen
    if joins:
        os.mkdir(joins[JOIN_DIR])

    def replace(local: int) -> subprocess.Popen[bytes]:
        """A replacement for local rank ``local``, which failed: it joins the others' group."""
        proc = start_rank(argv, dict(envs[local], FERRODIST_JOIN="1"), setup)
        procs[local] = proc
        log = open(os.path.join(log_dir, f"rank-{first + local}.log"), "ab") if log_dir is not None else None
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(proc.stdout, first + local, console, log), daemon=True)
        pump.start()
        pumps.append(pump)
        return proc

    try:
        for local in range(placement.local_size):
            rank = first + local
            logs.append(open(os.path.join(log_dir, f"rank-{rank}.log"), "wb") if log_dir is not None else None)
            env = dict(os.environ)
            env.update(extra_env or {}, **joins)
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
            envs.append(env)
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
            if joins:
                link.share_joins(joins[JOIN_DIR])
            link.start_heartbeats()
        watch = Watch(procs, signals, link)
        replacing = Replacements(replace, len(procs), grace) if tolerate else None
        interrupted = supervise(watch, grace, first, console, tolerate, replacing)
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
        kill_all(procs)  # nothing to do unless this failed half-way
        if link is not None:
            link.joins = None  # the ranks are gone, and so is their join directory
        remove_shared_memory(placement.job)
        shutil.rmtree(errors, ignore_errors=True)
        for log in logs[len(pumps) :]:
            if log is not None:
                log.close()
    for pump in pumps:
        pump.join(5)
    stopped = tuple(sorted(first + local for local in watch.stopped))
    returncodes = tuple(end.code for end in ends)
    lost = [end.rank for end in ends if end.code != 0]
    went_on = lost if interrupted is None and 0 < len(lost) <= tolerate and not watch.stopped else []
    if link is None and went_on:
        summary = finished_without(len(ends), went_on)
        console.line(summary)
        return JobResult(0, None, returncodes, stopped, summary)
    if link is None:
        verdict = diagnose(ends, interrupted=interrupted)
        if verdict.summary:
            console.line(verdict.summary)
        return JobResult(
            verdict.exit_code, verdict.culprits[0] if verdict.culprits else None, returncodes, stopped, verdict.summary
        )
    times = {first + local: at - watch.started for local, at in watch.exited_at.items()}
    outcome = link.finish(ends, times, interrupted, signals.fd, grace + 30 + link.silence, went_on)
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
