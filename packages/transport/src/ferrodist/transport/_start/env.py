"""Where this process sits in the job, read from the variables launchers set.

Recognised, in this order: ``RANK``/``WORLD_SIZE`` (``ferrodist run``, torchrun),
Open MPI's ``OMPI_COMM_WORLD_*``, MPICH/Hydra's ``PMI_RANK``/``PMI_SIZE``, PMIx's
``PMIX_RANK`` (with ``OMPI_COMM_WORLD_SIZE``), and SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``.

Under SLURM (``srun``), what the job does not say is derived where SLURM says enough:
``MASTER_ADDR`` is the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``,
``SLURM_NODELIST``), where SLURM puts task 0 unless told otherwise; ``MASTER_PORT`` is
``15000 + (31 * SLURM_JOB_ID + SLURM_STEP_ID) % 15000``, the same on every task of the step
and below Linux's ephemeral ports; every task is on one host when the step (else the job)
has one node (``SLURM_STEP_NUM_NODES``, ``SLURM_JOB_NUM_NODES``, ``SLURM_NNODES``).
``LaunchInfo.derived`` says which values were derived, and from what.

A launcher sets its variables together, so some of them without the others is a mistake
(a variable forgotten, or left over in the shell) and an error that names the missing ones,
never a silent world of one: ``RANK`` or ``WORLD_SIZE`` alone, ``OMPI_COMM_WORLD_RANK`` or
``OMPI_COMM_WORLD_SIZE`` alone, ``PMI_RANK`` or ``PMI_SIZE`` alone, ``PMIX_RANK`` without
``OMPI_COMM_WORLD_SIZE``. SLURM's are the exception: a batch script or an ``salloc`` shell
has ``SLURM_PROCID`` without ``SLURM_NTASKS`` (or the reverse) for the one process it runs.
``MASTER_ADDR`` and ``MASTER_PORT`` alone do not place a process (a caller may give the rank
and size itself, as ``torch.multiprocessing.spawn`` scripts do): :func:`launch_info` returns
``None`` for them, and ``init_process_group`` says what else it needs.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ferrodist.core import InvalidArgument

__all__ = ["LaunchInfo", "launch_info", "this_host"]

# (launcher, rank variable, size variable, local rank variables, local size variables)
_SOURCES = (
    ("env", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    ),
    ("pmi", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
    ("pmix", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ()),
)


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the job.

    Attributes:
        rank, world_size, local_rank: as the launcher numbered them.
        local_world_size: ranks on this host, when the launcher says (else ``None``).
        source: which launcher's variables were read (``"env"``, ``"openmpi"``, ``"pmi"``,
            ``"pmix"``, ``"slurm"``).
        master_addr, master_port: from ``MASTER_ADDR`` / ``MASTER_PORT``, when set (under
            SLURM, derived when not set and SLURM says enough).
        derived: what was derived rather than read, each as ``"NAME=value from VARIABLE"``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    source: str
    master_addr: str | None
    master_port: int | None
    derived: tuple[str, ...] = ()

    @property
    def under_mpi(self) -> bool:
        return self.source in ("openmpi", "pmi", "pmix")

    @property
    def single_host(self) -> bool:
        """True when the launcher says every rank runs on this host."""
        return self.local_world_size == self.world_size


#: What each variable of a job means, for the messages that ask for it.
_MEANING = {
    "RANK": "this process's rank, 0 to WORLD_SIZE - 1",
    "WORLD_SIZE": "the number of ranks",
    "MASTER_ADDR": "the host of rank 0",
    "MASTER_PORT": "a free port there",
    "LOCAL_RANK": "this process's rank on its host",
    "LOCAL_WORLD_SIZE": "the number of ranks on this host",
}
#: The variables ``ferrodist run`` and torchrun set on every rank, which a job needs all of.
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: The other launchers' pairs that never come apart (see the module docstring): (who sets them,
#: the variables).
_PAIRS = (
    ("Open MPI's mpiexec", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")),
    ("MPICH's mpiexec (Hydra)", ("PMI_RANK", "PMI_SIZE")),
    ("Open MPI's mpiexec (PMIx)", ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE")),
)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        meaning = f": it is {_MEANING[name]}" if name in _MEANING else ""
        raise InvalidArgument(
            f"environment variable {name}={env[name]!r} is not an integer{meaning}; set it to a number, or unset "
            "it (launchers such as `ferrodist run` set it themselves)"
        ) from None


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def launch_info(
    env: Mapping[str, str] | None = None, *, rank: int | None = None, world_size: int | None = None
) -> LaunchInfo | None:
    """The job position from the environment, or ``None`` when no launcher set one.

    Args:
        env: the variables to read (default ``os.environ``).
        rank, world_size: what the caller was told itself (``init_process_group``'s ``rank=``
            and ``world_size=``): they stand in for a ``RANK`` or ``WORLD_SIZE`` the
            environment lacks, never for one it has. Alone they place nothing (``None``).

    Raises:
        InvalidArgument: a variable is not an integer; the rank and size do not describe a
            rank of a job; or a launcher's variables are there only in part (see the module
            docstring): the message names the missing ones and what to do.

    Example::

        launch_info({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
        # LaunchInfo(rank=1, world_size=2, local_rank=1, ..., source='env', master_addr='h', ...)
        launch_info({"RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
        # InvalidArgument: WORLD_SIZE is not set but RANK=1, MASTER_ADDR='h' and MASTER_PORT='29500' are ...
    """
    env = os.environ if env is None else env
    for source, rank_var, size_var, *_ in _SOURCES:
        if rank_var in env and size_var in env:
            return _place(env, source, _int(env, rank_var), _int(env, size_var), rank_var, size_var)
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        if name in env:
            _int(env, name)  # a bad value is named before anything is said missing
    known_rank = _int(env, "RANK") if "RANK" in env else rank
    known_size = _int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else world_size
    if known_rank is not None and known_size is not None:
        if any(name in env for name in JOB_VARIABLES):  # RANK or WORLD_SIZE, or MASTER_* completed
            rank_var = "RANK" if "RANK" in env else "rank"
            size_var = "WORLD_SIZE" if "WORLD_SIZE" in env else "world_size"
            return _place(env, "env", known_rank, known_size, rank_var, size_var)
    elif "RANK" in env or "WORLD_SIZE" in env:
        raise InvalidArgument(_partial_job(env, rank, world_size))
    for launcher, names in _PAIRS:
        present = [name for name in names if name in env]
        if present and len(present) < len(names):
            missing = [name for name in names if name not in env]
            raise InvalidArgument(
                f"{_and(missing)} {'is' if len(missing) == 1 else 'are'} not set but "
                f"{_and([f'{name}={env[name]!r}' for name in present])} {'is' if len(present) == 1 else 'are'}: "
                f"{launcher} sets them together, so this process has a rank but no job size; start the ranks with "
                f"mpiexec -n N, set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT instead, or unset {_and(present)} "
                "to run this process alone"
            )
    return None


def _partial_job(env: Mapping[str, str], rank: int | None, world_size: int | None) -> str:
    """What is missing when some of :data:`JOB_VARIABLES` are set (and ``rank``/``world_size``
    given) but the rank or the size is still unknown, and what to do."""
    given = {"RANK": rank, "WORLD_SIZE": world_size}
    one = env.get("WORLD_SIZE") == "1" or world_size == 1  # a world of one needs no master
    missing = [
        name
        for name in JOB_VARIABLES
        if name not in env and given.get(name) is None and not (one and name.startswith("MASTER_"))
    ]
    present = [name for name in JOB_VARIABLES if name in env]
    shown = [f"{name}={env[name]!r}" for name in present]
    shown += [f"{name.lower()}={value} (argument)" for name, value in given.items() if value is not None]
    asked = _and([f"{name} ({_MEANING[name]})" for name in missing])
    return (
        f"{_and(missing)} {'is' if len(missing) == 1 else 'are'} not set but {_and(shown)} "
        f"{'is' if len(shown) == 1 else 'are'}: a rank of a job needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; "
        f"start the ranks with `ferrodist run -n N script.py` (or torchrun), which sets all four; or set {asked} on "
        f"every rank; or unset {_and(present)} to run this process alone"
    )


def _place(env: Mapping[str, str], source: str, rank: int, size: int, rank_var: str, size_var: str) -> LaunchInfo:
    """The :class:`LaunchInfo` of rank ``rank`` of ``size`` (read from ``rank_var`` and
    ``size_var``), with the rest of ``source``'s variables."""
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgument(
            f"{rank_var}={rank} and {size_var}={size} do not describe a rank of a job: start every rank with the "
            f"same {size_var} of at least 1 and its own {rank_var}, 0 to {max(size, 1) - 1}"
        )
    _, _, _, local_vars, local_size_vars = next(s for s in _SOURCES if s[0] == source)
    local = next((_int(env, v) for v in local_vars if v in env), rank)
    local_size = next((_int(env, v) for v in local_size_vars if v in env), None)
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    info = LaunchInfo(rank, size, local, local_size, source, env.get("MASTER_ADDR"), port)
    return _from_slurm(info, env) if source == "slurm" else info


def _from_slurm(info: LaunchInfo, env: Mapping[str, str]) -> LaunchInfo:
    """``info`` with what SLURM's variables say about the master and the host (see above)."""
    addr, port, local_size, derived = info.master_addr, info.master_port, info.local_world_size, []
    if addr is None:
        name = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)), None)
        if name is not None:
            addr = first_host(env[name])
            derived.append(f"MASTER_ADDR={addr} from {name}")
    if port is None and env.get("SLURM_JOB_ID"):
        job = _int(env, "SLURM_JOB_ID")
        step = _int(env, "SLURM_STEP_ID") if env.get("SLURM_STEP_ID", "").isdigit() else 0
        port = 15000 + (31 * job + step) % 15000
        derived.append(f"MASTER_PORT={port} from SLURM_JOB_ID" + (" and SLURM_STEP_ID" if step else ""))
    if local_size is None:
        name = next((v for v in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") if env.get(v)), None)
        if name is not None and _int(env, name) == 1:
            local_size = info.world_size
            derived.append(f"LOCAL_WORLD_SIZE={local_size} from {name}=1")
    return LaunchInfo(info.rank, info.world_size, info.local_rank, local_size, info.source, addr, port, tuple(derived))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``"gpu[003-004,010],cpu1"`` -> ``"gpu003"``,
    ``"rack[1-2]-n[5-6]"`` -> ``"rack1-n5"``.

    Raises:
        InvalidArgument: a ``[`` without its ``]``, or an empty list.
    """
    host, i = [], 0
    while i < len(nodelist) and nodelist[i] != ",":
        if nodelist[i] == "[":
            end = nodelist.find("]", i)
            if end < 0:
                raise InvalidArgument(f"SLURM host list {nodelist!r}: a '[' without its ']'")
            host.append(re.split(r"[,-]", nodelist[i + 1 : end])[0])
            i = end + 1
        else:
            host.append(nodelist[i])
            i += 1
    if not host:
        raise InvalidArgument(f"SLURM host list {nodelist!r} names no host")
    return "".join(host)


def this_host() -> str:
    """What tells this machine from others: its host name and its boot id (two containers
    of one machine may share a name; a machine rebooted is another run of it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
