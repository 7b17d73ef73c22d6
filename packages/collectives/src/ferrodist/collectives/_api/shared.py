"""Arrays in the memory a group's ranks share: collectives on them read the peers' arrays
where they are, instead of copying through the transport's slots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ferrodist.collectives._group import ProcessGroup
from ferrodist.core import DType, InvalidArgument, dtype

from .default_group import resolve

__all__ = ["reads_in_place", "shared_zeros", "shares_memory"]

#: Bytes of one rank's word in the exchange of segment addresses (longer text is cut).
_ROW = 256


def shared_zeros(shape: int | Sequence[int], dtype_: Any = "float32", group: ProcessGroup | None = None) -> Any:
    """A zero-filled numpy array of ``shape`` and ``dtype`` (any ferrodist dtype name, or a
    numpy dtype) in memory that every rank of ``group`` maps, where the group has such
    memory (a job on one host, the world group over shm); elsewhere an ordinary array.

    A collective: every rank of the group calls it with the same shape and dtype, in the
    same order. An all_reduce of an array made here, or of a contiguous slice of one (at
    the same place on every rank), of 1 MiB to 16 MiB reads every rank's array in place:
    no byte goes through the transport's slots. The memory is the group's: it goes when the
    group is destroyed and the last array on it is gone, and a killed rank leaves nothing
    in /dev/shm. ``torch.from_numpy`` gives a tensor on it.

    Example::

        grads = shared_zeros(1 << 20)      # 4 MiB of float32 on every rank
        grads[:] = compute()
        all_reduce(grads)                   # read in place from every rank's grads
    """
    g = resolve(group)
    dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
    if any(n < 0 for n in dims):
        raise InvalidArgument(
            f"rank {g.global_rank}: shared_zeros: shape {dims} has a negative size", rank=g.global_rank
        )
    dt = dtype_ if isinstance(dtype_, DType) else dtype(dtype_ if isinstance(dtype_, str) else np.dtype(dtype_).name)
    count = int(np.prod(dims, dtype=np.int64))
    if not shares_memory(g):
        return np.zeros(dims, dt.numpy)
    raw = g._route.native.allocate(count * dt.numpy.itemsize, lambda text: _exchange(g, text))  # type: ignore[union-attr]
    return raw.view(dt.numpy).reshape(dims)


def shares_memory(group: ProcessGroup | None = None) -> bool:
    """Whether ``shared_zeros`` on ``group`` gives arrays in memory its ranks share (the
    world group of a job on one host over shm), rather than ordinary ones."""
    g = resolve(group)
    return g.is_member and hasattr(g._route.native, "allocate")  # the transports that share memory offer it


def reads_in_place(nbytes: int, group: ProcessGroup | None = None) -> bool:
    """Whether an all_reduce of ``nbytes`` bytes of an array from ``shared_zeros`` on
    ``group`` reads the peers' arrays in place (the group shares memory, and the size is
    in the range where that is the faster way); elsewhere such an array goes through the
    transport's slots like any other, and an ordinary array would do as well."""
    g = resolve(group)
    if not shares_memory(g):
        return False
    low, high = g._route.native.in_place_bytes  # type: ignore[union-attr]
    return bool(low <= nbytes <= high)


def _exchange(group: ProcessGroup, text: str) -> list[str]:
    """Every rank's ``text`` (at most ``_ROW`` bytes of it), in group-rank order."""
    mine = np.zeros(_ROW, np.uint8)
    data = text.encode()[:_ROW]
    mine[: len(data)] = np.frombuffer(data, np.uint8)
    rows = np.zeros((group.size, _ROW), np.uint8)
    group.all_gather(rows, mine)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]
