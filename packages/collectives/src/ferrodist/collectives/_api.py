"""Module-level collectives, shaped like ``torch.distributed``.

They act on ``group`` (the default group when ``None``). As in torch, ``src``,
``dst`` and peers are *global* ranks here; ``ProcessGroup`` methods take group ranks.
"""

from __future__ import annotations

from typing import Any

from ferrodist.core import ReduceOp

from ._group import ProcessGroup
from ._state import resolve
from ._work import Work


def all_reduce(
    tensor: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
    algorithm: str | None = None,
    compress: str | None = None,
) -> Work | None:
    """Reduce ``tensor`` across the group, in place on every rank. See ``ProcessGroup.all_reduce``.

    Example::

        x = np.array([1.0, 2.0]) * (get_rank() + 1)   # rank 0: [1, 2]  rank 1: [2, 4]
        all_reduce(x)                                  # rank 0: [3, 6]  rank 1: [3, 6]
    """
    return resolve(group).all_reduce(
        tensor, op, async_op=async_op, timeout=timeout, algorithm=algorithm, compress=compress
    )


def broadcast(
    tensor: Any, src: int, group: ProcessGroup | None = None, async_op: bool = False, *, timeout: float | None = None
) -> Work | None:
    """Copy global rank ``src``'s ``tensor`` to every rank of the group."""
    g = resolve(group)
    return g.broadcast(tensor, g.group_rank(src), async_op=async_op, timeout=timeout)


def reduce(
    tensor: Any,
    dst: int,
    op: ReduceOp | str = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
) -> Work | None:
    """Reduce ``tensor`` across the group into global rank ``dst``'s ``tensor``."""
    g = resolve(group)
    return g.reduce(tensor, g.group_rank(dst), op, async_op=async_op, timeout=timeout)


def all_gather(
    output: Any, tensor: Any, group: ProcessGroup | None = None, async_op: bool = False, *, timeout: float | None = None
) -> Work | None:
    """Gather every rank's ``tensor`` into ``output`` on every rank (a list, or one tensor)."""
    return resolve(group).all_gather(output, tensor, async_op=async_op, timeout=timeout)


def reduce_scatter(
    output: Any,
    input: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
) -> Work | None:
    """Reduce ``input`` blocks across ranks; block i's result lands in group rank i's ``output``."""
    return resolve(group).reduce_scatter(output, input, op, async_op=async_op, timeout=timeout)


def gather(
    tensor: Any,
    gather_list: Any = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
) -> Work | None:
    """Collect every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    g = resolve(group)
    return g.gather(tensor, gather_list, g.group_rank(dst), async_op=async_op, timeout=timeout)


def scatter(
    tensor: Any,
    scatter_list: Any = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
) -> Work | None:
    """Send block i of ``scatter_list`` on global rank ``src`` into group rank i's ``tensor``."""
    g = resolve(group)
    return g.scatter(tensor, scatter_list, g.group_rank(src), async_op=async_op, timeout=timeout)


def all_to_all(
    outputs: Any,
    inputs: Any,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
) -> Work | None:
    """Group rank i's ``inputs[j]`` lands in group rank j's ``outputs[i]``."""
    return resolve(group).all_to_all(outputs, inputs, async_op=async_op, timeout=timeout)


def barrier(group: ProcessGroup | None = None, async_op: bool = False, *, timeout: float | None = None) -> Work | None:
    """Return once every rank of the group has entered the barrier."""
    return resolve(group).barrier(async_op=async_op, timeout=timeout)


def send(
    tensor: Any, dst: int, group: ProcessGroup | None = None, tag: int = 0, *, timeout: float | None = None
) -> None:
    """Send ``tensor`` to global rank ``dst``."""
    g = resolve(group)
    g.send(tensor, g.group_rank(dst), tag, timeout=timeout)


def recv(
    tensor: Any, src: int, group: ProcessGroup | None = None, tag: int = 0, *, timeout: float | None = None
) -> None:
    """Receive into ``tensor`` from global rank ``src``."""
    g = resolve(group)
    g.recv(tensor, g.group_rank(src), tag, timeout=timeout)


def isend(tensor: Any, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; returns a ``Work``."""
    g = resolve(group)
    return g.isend(tensor, g.group_rank(dst), tag)


def irecv(tensor: Any, src: int, group: ProcessGroup | None = None, tag: int = 0) -> Work:
    """Start receiving into ``tensor`` from global rank ``src``; returns a ``Work``."""
    g = resolve(group)
    return g.irecv(tensor, g.group_rank(src), tag)
