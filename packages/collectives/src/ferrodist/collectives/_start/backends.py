"""Starting a backend: from ``init_process_group``'s arguments and the environment to a transport.

Under torchrun, whose agent holds ``MASTER_PORT`` with its own store, the job starts
through that store instead (``_torchrun_store``): rank 0 hosts ferrodist's store on a
port the OS picks and publishes it there (``TcpTransport.connect(rendezvous=...)``).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from ferrodist.core import BackendUnavailable, InvalidArgument
from ferrodist.transport import (
    KeyValue,
    LaunchInfo,
    MpiTransport,
    ShmTransport,
    SimulatedTransport,
    TcpTransport,
    Transport,
    launch_info,
)

from .levels import NODE_VARIABLES

#: Backends ``init_process_group`` can start ("auto" picks one; "gloo" is a name for "auto";
#: "nccl" is "auto" with CUDA tensors through NCCL). "levels" is tcp between nodes and
#: shared memory inside each (see ``_levels``).
BACKENDS = ("simulated", "tcp", "shm", "mpi", "levels")
_log = logging.getLogger("ferrodist.collectives")
#: The backends that read the launcher's variables ("simulated" and "mpi" do not).
_READS_ENV = ("auto", "gloo", "nccl", "tcp", "shm", "levels")
_MEANING = {
    "RANK": "this process's rank, 0 to WORLD_SIZE - 1",
    "WORLD_SIZE": "the number of ranks",
    "MASTER_ADDR": "the host of rank 0",
    "MASTER_PORT": "a free port there",
}


def make_transport(
    backend: str,
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    timeout: float,
    start_timeout: float | None = None,
) -> tuple[Transport, bool]:
    """This rank's transport for ``backend``, and whether the world group should run over two
    levels (``"levels"``, which ``auto`` picks for jobs over several hosts). The transport
    waits ``timeout`` by default; its start may take ``start_timeout`` (default: ``timeout``)."""
    start = timeout if start_timeout is None else start_timeout
    info = None
    if backend in _READS_ENV:
        try:
            info = launch_info(rank=rank, world_size=world_size)
        except InvalidArgument as exc:
            if init_method in (None, "env://"):
                _tell_the_others(exc)
            raise InvalidArgument(f"init_process_group: {exc}") from None
    if backend in ("auto", "gloo", "nccl"):
        if info is None and world_size is None and init_method in (None, "env://") and _master_in_env():
            _where(info, rank, world_size, init_method, alone=True)  # MASTER_* alone: raises, naming what is missing
        chosen, _ = _auto(info, rank, world_size, init_method)
        if backend == "gloo":
            _warn_caller(
                f"init_process_group('gloo') runs over ferrodist's own {chosen!r} transport (what 'auto' picks for "
                "this job), not over Gloo: ferrodist.collectives takes the name so that torch scripts run unchanged; "
                "pass 'auto' (or no backend) to say what you mean"
            )
        if chosen == "simulated" and info is None and world_size is None:
            _warn_caller(
                "init_process_group: no launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) are set, so this "
                "process is a world of one rank; start several with `ferrodist run -n N script.py` (or torchrun, "
                "mpiexec), or pass backend='simulated' for a world of one without this warning"
            )
        if backend == "nccl":
            _log.info(
                "init_process_group: backend 'nccl' runs CPU tensors over ferrodist's own %r transport and CUDA "
                "tensors through NCCL (cuda_route='nccl')",
                chosen,
            )
        backend = chosen
    if backend == "simulated":
        if world_size not in (None, 1) or rank not in (None, 0):
            raise InvalidArgument(
                f"init_process_group: a simulated world of {world_size} ranks runs its ranks as threads; "
                "use ferrodist.testing.run_world(n, fn), or give each thread "
                "transport=SimulatedTransport.create_group(n)[rank]"
            )
        return SimulatedTransport.create_group(1, timeout=timeout)[0], False
    levels = backend == "levels"
    if levels:
        backend = "tcp"
    if backend in ("tcp", "shm"):
        rank, world_size, addr, port = _where(info, rank, world_size, init_method)
        kind = ShmTransport if backend == "shm" else TcpTransport
        # Under torchrun the job starts through its agent's store; else rank 0 hosts ferrodist's.
        through: dict[str, Any] = {"master_port": port}
        if init_method in (None, "env://") and under_torchrun():
            through = {"rendezvous": _torchrun_store(addr, port, start)}
        transport = kind.connect(
            rank=rank, world_size=world_size, master_addr=addr, timeout=timeout, start_timeout=start, **through
        )
        if info is not None and info.local_world_size:
            transport.share_host(info.local_world_size)  # waits give the core away where ranks outnumber cores
        return transport, levels
    if backend == "mpi":
        return _mpi_transport(info, rank, world_size, timeout), False
    raise InvalidArgument(
        f"init_process_group: unknown backend {backend!r}; available: {', '.join(BACKENDS)}, auto (and gloo, a name "
        "for auto; nccl, auto with CUDA tensors through NCCL)"
    )


def connect_transport(kind: str, store: KeyValue, *, rank: int, world_size: int, timeout: float) -> Transport:
    """This rank's transport of ``kind`` (``"shm"``, ``"tcp"`` or ``"mpi"``) for a job whose
    ranks all reach ``store``, a key-value store (``set``/``get``/``add``/``wait``, as
    torch's stores have): rank 0 publishes the address of ferrodist's own store there, so
    nothing else has to be agreed on. ``MASTER_ADDR`` (when set) says which interface to
    listen on. ``mpi`` is the world of every MPI rank, in MPI's order, and nothing else."""
    if kind == "mpi":
        transport = MpiTransport(timeout=timeout)
        if (transport.rank, transport.world_size) != (rank, world_size):
            transport.close()
            raise BackendUnavailable(
                f"rank {rank}: the mpi transport runs only the group of every MPI rank, in MPI's order; this group "
                f"is rank {rank} of {world_size} but MPI says rank {transport.rank} of {transport.world_size}: use "
                "shm or tcp for other groups"
            )
        return transport
    if kind not in ("shm", "tcp"):
        raise InvalidArgument(f"rank {rank}: connect_transport: kind must be 'shm', 'tcp' or 'mpi', not {kind!r}")
    cls = ShmTransport if kind == "shm" else TcpTransport
    addr = os.environ.get("MASTER_ADDR") or None
    return cls.connect(rank=rank, world_size=world_size, rendezvous=store, master_addr=addr, timeout=timeout)


def one_host() -> bool | None:
    """Whether the launcher's variables (``ferrodist run``'s, torchrun's, mpiexec's, SLURM's)
    say that every rank of the job runs on this host; False where no launcher placed this
    process, None where its variables do not add up."""
    try:
        info = launch_info()
    except InvalidArgument as exc:
        _log.info("the launcher's variables do not say where the ranks run (%s)", exc)
        return None
    return info is not None and info.single_host


def under_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True in a worker that torchrun (torch.distributed.elastic) started with its agent's
    store on ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``): that port
    is taken, and the job starts through the store there."""
    env = os.environ if env is None else env
    return "TORCHELASTIC_RUN_ID" in env and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _torchrun_store(addr: str, port: int, timeout: float) -> KeyValue:
    """A client of torchrun's agent store, its keys under this run and restart (a restarted
    job never reads the records of the attempt before it)."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise BackendUnavailable(
            f"init_process_group: this process runs under torchrun (TORCHELASTIC_RUN_ID is set) but torch cannot be "
            f"imported ({exc}) to reach its store at {addr}:{port}"
        ) from None
    from datetime import timedelta

    try:
        store: Any = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as exc:
        raise BackendUnavailable(
            f"init_process_group: cannot reach torchrun's store at {addr}:{port} (MASTER_ADDR:MASTER_PORT): {exc}"
        ) from None
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed: Any = dist.PrefixStore(f"ferrodist/{run}/attempt-{attempt}", store)
    return prefixed


def _tell_the_others(error: InvalidArgument) -> None:
    """``RANK`` and ``WORLD_SIZE`` do not describe a rank: when ``MASTER_ADDR`` and
    ``MASTER_PORT`` say where the job starts, tell its other ranks why this one will not
    come, so that they fail now instead of at their timeout."""
    env = os.environ
    try:
        rank, world_size, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        addr = env["MASTER_ADDR"]
    except (KeyError, ValueError):
        return
    reason = InvalidArgument(
        f"a process (pid {os.getpid()}) was started with RANK={rank} and WORLD_SIZE={world_size}, which do not "
        f"describe a rank of a job ({error}): start every rank with the same WORLD_SIZE and a RANK below it"
    )
    TcpTransport.report_bad_start(reason, rank=rank, world_size=world_size, master_addr=addr, master_port=port)


def auto_backend(env: Mapping[str, str] | None = None) -> tuple[str, str, LaunchInfo | None]:
    """What ``init_process_group("auto")`` picks in a process with the environment ``env``
    (this process's when None), in words why, and the launcher's placement it read (None
    where no launcher placed the process). ``InvalidArgument`` where the launcher's
    variables do not add up."""
    info = launch_info(env)
    backend, why = _auto(info, None, None, None, env)
    return backend, why, info


def _warn_caller(message: str) -> None:
    """A ``UserWarning`` that points at the first line outside this package (the user's
    ``init_process_group`` call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    level, frame = 2, sys._getframe(1)
    while os.path.abspath(frame.f_code.co_filename).startswith(package) and frame.f_back is not None:
        level += 1
        frame = frame.f_back
    warnings.warn(message, UserWarning, stacklevel=level)


def _auto(
    info: LaunchInfo | None,
    rank: int | None,
    world_size: int | None,
    init_method: str | None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """mpi under mpiexec (when mpi4py is there and no master address is given), shm when the
    launcher says every rank is on this host (``ferrodist run``, torchrun and mpiexec say how
    many ranks run here), levels when it says they span hosts (it says how many run here,
    or which node this is: ``GROUP_RANK``, ``NODE_RANK``, ``SLURM_NODEID``; shared memory
    inside each node and tcp between, flat tcp where each node runs one rank), tcp for any
    other job of several ranks, else a simulated world of one; and why."""
    size = world_size if world_size is not None else (info.world_size if info else 1)
    if info is not None and info.under_mpi and init_method is None and info.master_addr is None:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            pass
        else:
            return "mpi", "started by mpiexec, mpi4py installed, no MASTER_ADDR"
    if size == 1 and init_method is None:
        return "simulated", "a world of one" if info is not None else "no launcher variables: a world of one"
    if info is not None and info.single_host and world_size in (None, info.world_size):
        return "shm", "every rank on this host"
    env = os.environ if env is None else env
    said = info is not None and (info.local_world_size is not None or any(env.get(v) for v in NODE_VARIABLES))
    if said and world_size in (None, info.world_size if info else None):
        return "levels", "ranks on several hosts: shared memory inside each node, tcp between nodes"
    return "tcp", "the launcher does not say how many ranks run on this host, or which node"


def _mpi_transport(info: LaunchInfo | None, rank: int | None, world_size: int | None, timeout: float) -> Transport:
    transport = MpiTransport(timeout=timeout)
    for name, wanted, actual in (("rank", rank, transport.rank), ("world_size", world_size, transport.world_size)):
        if wanted is not None and wanted != actual:
            transport.close()
            raise InvalidArgument(f"init_process_group: {name}={wanted} but MPI says {actual}")
    return transport


def _where(
    info: LaunchInfo | None, rank: int | None, world_size: int | None, init_method: str | None, *, alone: bool = False
) -> tuple[int, int, str, int]:
    """Rank, world size and master address for a socket backend: from the arguments, else the
    launcher's variables (``info``, or ``MASTER_ADDR``/``MASTER_PORT`` alone when nothing
    placed this process), else ``init_method``'s address. ``alone``: the backend would run a
    process without these variables as a world of one (say so when they are missing)."""
    env = os.environ
    method = init_method or "env://"
    addr: str | None
    port: int | None
    if method.startswith("tcp://"):
        url = urlparse(method)
        if not url.hostname or not url.port:
            raise InvalidArgument(f"init_method {method!r}: expected tcp://HOST:PORT")
        addr, port = url.hostname, url.port
    elif method != "env://":
        raise InvalidArgument(f"init_method {method!r} is not supported; use 'env://' or 'tcp://HOST:PORT'")
    elif info is not None:
        addr, port = info.master_addr, info.master_port
    else:
        addr = env.get("MASTER_ADDR")
        port = _port(env["MASTER_PORT"]) if "MASTER_PORT" in env else None
    given = {"rank": rank, "world_size": world_size}
    rank = rank if rank is not None else (info.rank if info else None)
    world_size = world_size if world_size is not None else (info.world_size if info else None)
    known = {"RANK": rank, "WORLD_SIZE": world_size, "MASTER_ADDR": addr, "MASTER_PORT": port}
    missing = [name for name, value in known.items() if value is None]
    if missing:
        if info is not None and info.under_mpi:
            raise InvalidArgument(
                f"init_process_group: rank {info.rank} was started by mpiexec, which sets no {', '.join(missing)}; "
                "use init_process_group('mpi') (or 'auto'), or pass the address to every rank: "
                "mpiexec -x MASTER_ADDR=HOST -x MASTER_PORT=PORT ... (or init_method='tcp://HOST:PORT')"
            )
        raise InvalidArgument(_missing_message(missing, given, info, alone))
    assert rank is not None and world_size is not None and addr is not None and port is not None
    return rank, world_size, addr, port


def _master_in_env() -> bool:
    return "MASTER_ADDR" in os.environ or "MASTER_PORT" in os.environ


def _port(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(
            f"init_process_group: environment variable MASTER_PORT={text!r} is not an integer: it is a free port on "
            "the host of rank 0; set it to a number, or unset it"
        ) from None


def _missing_message(missing: list[str], given: dict[str, int | None], info: LaunchInfo | None, alone: bool) -> str:
    """``init_process_group``'s error when a socket backend lacks ``missing``: how to give it
    the rest, and what this process was given."""
    env = os.environ
    set_here = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name in env]
    have = [f"{name}={env[name]!r}" for name in set_here]
    have += [f"{name}={value} (argument)" for name, value in given.items() if value is not None]
    if info is not None and info.source != "env":
        have.append(f"rank {info.rank} of {info.world_size} from {info.source}'s variables")
    asked = ", ".join(f"{name} ({_MEANING[name]})" for name in missing)
    unset = ""
    if alone and set_here and all(value is None for value in given.values()):
        unset = f"; or unset {', '.join(set_here)} to run this process alone"
    return (
        f"init_process_group: {', '.join(missing)} not set; start the ranks with `ferrodist run -n N script.py` (or "
        f"torchrun), which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; or set {asked} on every rank (or "
        f"pass init_method='tcp://HOST:PORT', rank=, world_size=){unset}"
        + (f" (this process has {', '.join(have)})" if have else "")
    )
