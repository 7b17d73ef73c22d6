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
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ferrodist.core import InvalidArgument

__all__ = ["LaunchInfo", "launch_info"]

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


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise InvalidArgument(f"environment variable {name}={env[name]!r} is not an integer") from None


def launch_info(env: Mapping[str, str] | None = None) -> LaunchInfo | None:
    """The job position from the environment, or ``None`` when no launcher set one."""
    env = os.environ if env is None else env
    for source, rank_var, size_var, local_vars, local_size_vars in _SOURCES:
        if rank_var in env and size_var in env:
            rank, size = _int(env, rank_var), _int(env, size_var)
            if size < 1 or not 0 <= rank < size:
                raise InvalidArgument(f"{rank_var}={rank} and {size_var}={size} do not describe a rank of a job")
            local = next((_int(env, v) for v in local_vars if v in env), rank)
            local_size = next((_int(env, v) for v in local_size_vars if v in env), None)
            port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
            info = LaunchInfo(rank, size, local, local_size, source, env.get("MASTER_ADDR"), port)
            return _from_slurm(info, env) if source == "slurm" else info
    return None


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
