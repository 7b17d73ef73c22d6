"""Starting a backend: from ``init_process_group``'s arguments and the environment to a transport."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from ferrodist.core import BackendUnavailable, InvalidArgument
from ferrodist.transport import (
    LaunchInfo,
    MpiTransport,
    ShmTransport,
    SimulatedTransport,
    TcpTransport,
    Transport,
    launch_info,
)

#: Backends ``init_process_group`` can start ("auto" picks one).
BACKENDS = ("simulated", "tcp", "shm", "mpi")
_LATER = ("nccl", "gloo")


def make_transport(
    backend: str, init_method: str | None, rank: int | None, world_size: int | None, timeout: float
) -> Transport:
    try:
        info = launch_info()
    except InvalidArgument as exc:
        if backend in ("auto", "tcp", "shm") and init_method in (None, "env://"):
            _tell_the_others(exc)
        raise
    if backend == "auto":
        backend = _auto(info, rank, world_size, init_method)
    if backend == "simulated":
        if world_size not in (None, 1) or rank not in (None, 0):
            raise InvalidArgument(
                f"init_process_group: a simulated world of {world_size} ranks runs its ranks as threads; "
                "use ferrodist.testing.run_world(n, fn), or give each thread "
                "transport=SimulatedTransport.create_group(n)[rank]"
            )
        return SimulatedTransport.create_group(1, timeout=timeout)[0]
    if backend in ("tcp", "shm"):
        rank, world_size, addr, port = _where(info, rank, world_size, init_method)
        kind = ShmTransport if backend == "shm" else TcpTransport
        return kind.connect(rank=rank, world_size=world_size, master_addr=addr, master_port=port, timeout=timeout)
    if backend == "mpi":
        return _mpi_transport(info, rank, world_size, timeout)
    if backend in _LATER:
        raise BackendUnavailable(
            f"init_process_group: backend {backend!r} is not part of this ferrodist release; "
            f"available: {', '.join(BACKENDS)} (or 'auto')"
        )
    raise InvalidArgument(f"init_process_group: unknown backend {backend!r}; available: {', '.join(BACKENDS)}, auto")


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


def _auto(info: LaunchInfo | None, rank: int | None, world_size: int | None, init_method: str | None) -> str:
    """mpi under mpiexec (when mpi4py is there and no master address is given), shm when the
    launcher says every rank is on this host, tcp for any other job of several ranks, else a
    simulated world of one."""
    size = world_size if world_size is not None else (info.world_size if info else 1)
    if info is not None and info.under_mpi and init_method is None and info.master_addr is None:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            pass
        else:
            return "mpi"
    if size == 1 and init_method is None:
        return "simulated"
    if info is not None and info.single_host and world_size in (None, info.world_size):
        return "shm"
    return "tcp"


def _mpi_transport(info: LaunchInfo | None, rank: int | None, world_size: int | None, timeout: float) -> Transport:
    transport = MpiTransport(timeout=timeout)
    for name, wanted, actual in (("rank", rank, transport.rank), ("world_size", world_size, transport.world_size)):
        if wanted is not None and wanted != actual:
            transport.close()
            raise InvalidArgument(f"init_process_group: {name}={wanted} but MPI says {actual}")
    return transport


def _where(
    info: LaunchInfo | None, rank: int | None, world_size: int | None, init_method: str | None
) -> tuple[int, int, str, int]:
    """Rank, world size and master address for a socket backend."""
    addr = info.master_addr if info else None
    port = info.master_port if info else None
    method = init_method or "env://"
    if method.startswith("tcp://"):
        url = urlparse(method)
        if not url.hostname or not url.port:
            raise InvalidArgument(f"init_method {method!r}: expected tcp://HOST:PORT")
        addr, port = url.hostname, url.port
    elif method != "env://":
        raise InvalidArgument(f"init_method {method!r} is not supported; use 'env://' or 'tcp://HOST:PORT'")
    rank = rank if rank is not None else (info.rank if info else None)
    world_size = world_size if world_size is not None else (info.world_size if info else None)
    missing = [
        name
        for name, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("MASTER_ADDR", addr), ("MASTER_PORT", port))
        if value is None
    ]
    if missing:
        raise InvalidArgument(
            f"init_process_group: {', '.join(missing)} not set; start the ranks with `ferrodist run -n N script.py`, "
            "or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (or pass init_method='tcp://HOST:PORT', rank=, "
            "world_size=)"
        )
    assert rank is not None and world_size is not None and addr is not None and port is not None
    return rank, world_size, addr, port
