"""Communicator options (``ncclConfig_t``) and argument checks shared by the communicator."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ferrodist.core import InvalidArgument, InvalidRank

from ._library import CONFIG_FIELDS, CONFIG_LAYOUT_VERSION, UNIQUE_ID_BYTES, ConfigStruct

__all__ = ["DEFAULT_TIMEOUT", "NcclConfig", "check_timeout", "check_world"]

#: Seconds a blocking NCCL call (init, a collective, close) may take before it is aborted.
DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class NcclConfig:
    """Options for ``ncclCommInitRankConfig``; ``None`` leaves NCCL's own default.

    Attributes:
        blocking: ``False`` (the default) creates a non-blocking communicator: NCCL calls
            return at once and ferrodist polls them against a timeout, so a rank that never
            arrives gives ``CollectiveTimeout`` instead of a hang. ``True`` is NCCL's default
            mode, where ``ncclCommInitRank`` itself waits for every rank, with no timeout.
        cga_cluster_size, min_ctas, max_ctas: kernel launch tuning (see NCCL's docs).
        net_name: force a network plugin (``"IB"``, ``"Socket"``).
        comm_name: a name shown in NCCL's logs.
        split_share: share resources with communicators split from this one.
    """

    blocking: bool = False
    cga_cluster_size: int | None = None
    min_ctas: int | None = None
    max_ctas: int | None = None
    net_name: str | None = None
    comm_name: str | None = None
    split_share: bool | None = None

    def to_struct(self, version: tuple[int, int, int] = CONFIG_LAYOUT_VERSION) -> ConfigStruct:
        """The ``ncclConfig_t`` of NCCL release ``version`` (the loaded library's) for these options.

        Raises:
            InvalidArgument: an option is malformed, or the release has no such field (the
                message names the release that added it).
        """
        config = ConfigStruct.initialized(version)
        since = {name: added for name, _, added in CONFIG_FIELDS}
        for field, option in (
            ("blocking", "blocking"),
            ("cgaClusterSize", "cga_cluster_size"),
            ("minCTAs", "min_ctas"),
            ("maxCTAs", "max_ctas"),
            ("netName", "net_name"),
            ("commName", "comm_name"),
            ("splitShare", "split_share"),
        ):
            value = getattr(self, option)
            if value is None:
                continue
            if option in ("cga_cluster_size", "min_ctas", "max_ctas") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise InvalidArgument(f"NcclConfig: {option} ({field}) must be a non-negative integer, not {value!r}")
            if since[field] > tuple(version):
                raise InvalidArgument(
                    f"NcclConfig: {option} needs NCCL >= {since[field][0]}.{since[field][1]} "
                    f"(ncclConfig_t.{field}); the loaded NCCL is {'.'.join(map(str, version))}: "
                    "install a newer nvidia-nccl wheel or leave it unset"
                )
            setattr(config, field, value.encode() if isinstance(value, str) else int(value))
        return config


def check_timeout(timeout: float | None, default: float, operation: str) -> float:
    """``timeout`` (or ``default`` when ``None``) as positive finite seconds."""
    value = default if timeout is None else timeout
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise InvalidArgument(f"{operation}: timeout must be a positive number of seconds, not {timeout!r}")
    return float(value)


def check_world(rank: int, size: int, unique_id: bytes) -> bytes:
    """Validate ``(rank, size, unique_id)`` before any CUDA or NCCL call."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgument(f"NcclCommunicator: size must be a positive integer, not {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise InvalidRank(f"NcclCommunicator: rank {rank!r} is outside 0..{size - 1}", rank=None)
    try:
        raw = b"" if isinstance(unique_id, int) else bytes(memoryview(unique_id))
    except TypeError:
        raw = b""
    if len(raw) != UNIQUE_ID_BYTES or not any(raw):
        raise InvalidArgument(
            f"rank {rank}: NcclCommunicator: unique_id must be the {UNIQUE_ID_BYTES} bytes of get_unique_id() "
            f"made on rank 0, not {type(unique_id).__name__} of length {len(raw)}",
            rank=rank,
        )
    return raw
