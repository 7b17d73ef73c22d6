"""Where this process sits in the job, read from the variables launchers set.

Recognised, in this order: ``RANK``/``WORLD_SIZE`` (``ferrodist run``, torchrun),
Open MPI's ``OMPI_COMM_WORLD_*``, MPICH/Hydra's ``PMI_RANK``/``PMI_SIZE``, PMIx's
``PMIX_RANK`` (with ``OMPI_COMM_WORLD_SIZE``), and SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``.
"""

from __future__ import annotations

import os
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
        master_addr, master_port: from ``MASTER_ADDR`` / ``MASTER_PORT``, when set.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    source: str
    master_addr: str | None
    master_port: int | None

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
            return LaunchInfo(rank, size, local, local_size, source, env.get("MASTER_ADDR"), port)
    return None
