"""Module-level collectives, shaped like ``torch.distributed``.

They act on ``group`` (the default group when ``None``). As in torch, ``src``,
``dst`` and peers are *global* ranks here; ``ProcessGroup`` methods take group ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferrodist.collectives._composed import objects, tensors
from ferrodist.collectives._group import ProcessGroup
from ferrodist.collectives._start import levels
from ferrodist.collectives._timeouts import Timeout
from ferrodist.collectives._work import Work
from ferrodist.core import InvalidArgument, ReduceOp
from ferrodist.transport import Transport

from .default_group import resolve


def all_reduce(
    tensor: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
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
    tensor: Any, src: int, group: ProcessGroup | None = None, async_op: bool = False, *, timeout: Timeout = None
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
    timeout: Timeout = None,
) -> Work | None:
    """Reduce ``tensor`` across the group into global rank ``dst``'s ``tensor``."""
    g = resolve(group)
    return g.reduce(tensor, g.group_rank(dst), op, async_op=async_op, timeout=timeout)


def all_gather(
    output: Any, tensor: Any, group: ProcessGroup | None = None, async_op: bool = False, *, timeout: Timeout = None
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
    timeout: Timeout = None,
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
    timeout: Timeout = None,
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
    timeout: Timeout = None,
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
    timeout: Timeout = None,
) -> Work | None:
    """Group rank i's ``inputs[j]`` lands in group rank j's ``outputs[i]``."""
    return resolve(group).all_to_all(outputs, inputs, async_op=async_op, timeout=timeout)


def barrier(
    group: ProcessGroup | None = None, async_op: bool = False, device_ids: Any = None, timeout: Timeout = None
) -> Work | None:
    """Return once every rank of the group has entered the barrier.

    ``device_ids`` (torch's list of GPU indices for NCCL) is checked and ignored: the
    barrier moves no tensor, on any backend.
    """
    g = resolve(group)
    if device_ids is not None and (
        not isinstance(device_ids, (list, tuple))
        or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in device_ids)
    ):
        raise InvalidArgument(
            f"rank {g.global_rank}: barrier: device_ids must be a list of GPU indices (ints >= 0) or None, "
            f"not {device_ids!r}",
            rank=g.global_rank,
            operation="barrier",
        )
    return g.barrier(async_op=async_op, timeout=timeout)


def peer_rank(g: ProcessGroup, operation: str, rank: int | None, group_rank: int | None, name: str) -> int | None:
    """The group rank of a peer given as a global rank (``src``/``dst``) or as a group rank
    (``group_src``/``group_dst``); None when neither is given."""
    if rank is not None and group_rank is not None:
        raise InvalidArgument(
            f"rank {g.global_rank}: {operation}: pass {name} (a global rank) or group_{name} (a rank of the group), "
            "not both",
            rank=g.global_rank,
            operation=operation,
        )
    if group_rank is not None:
        return group_rank
    return None if rank is None else g.group_rank(rank)


def send(
    tensor: Any,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> None:
    """Send ``tensor`` to global rank ``dst`` (or group rank ``group_dst``)."""
    g = resolve(group)
    g.send(tensor, _destination(g, "send", dst, group_dst), tag, timeout=timeout)


def recv(
    tensor: Any,
    src: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
    *,
    timeout: Timeout = None,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (or group rank ``group_src``);
    returns the sender's global rank.

    Without either, from any other rank of the group: the next message with ``tag`` that
    any of them sends (the sender's messages in the order they were sent; between a
    receive from any rank and one that names the sender, the one posted first takes it).

    Example (a work queue: rank 0 collects results in the order they are ready)::

        if rank == 0:
            for _ in range(world_size - 1):
                result = np.empty(2)
                sender = recv(result)   # whichever worker finished first
        else:
            send(np.array([rank, rank * 10.0]), dst=0)
    """
    g = resolve(group)
    return g.ranks[g.recv(tensor, peer_rank(g, "recv", src, group_src, "src"), tag, timeout=timeout)]


def isend(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> Work:
    """Start sending ``tensor`` to global rank ``dst`` (or group rank ``group_dst``); returns a ``Work``."""
    g = resolve(group)
    return g.isend(tensor, _destination(g, "isend", dst, group_dst), tag)


def irecv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> Work:
    """Start receiving into ``tensor`` from global rank ``src`` (or group rank ``group_src``;
    without either, from any other rank, as for ``recv``); returns a ``Work`` whose
    ``source`` is the sender's group rank once it has finished."""
    g = resolve(group)
    return g.irecv(tensor, peer_rank(g, "irecv", src, group_src, "src"), tag)


def _destination(g: ProcessGroup, operation: str, dst: int | None, group_dst: int | None) -> int:
    peer = peer_rank(g, operation, dst, group_dst, "dst")
    if peer is None:
        raise InvalidArgument(
            f"rank {g.global_rank}: {operation}: name the destination with dst= (a global rank) or group_dst=",
            rank=g.global_rank,
            operation=operation,
        )
    return peer


# -- torch's other names ---------------------------------------------------------------------------
def all_gather_into_tensor(
    output_tensor: Any,
    input_tensor: Any,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """Every rank's ``input_tensor`` into ``output_tensor`` (concatenated along dim 0, or
    stacked)."""
    return tensors.all_gather_into_tensor(
        resolve(group), output_tensor, input_tensor, async_op=async_op, timeout=timeout
    )


def reduce_scatter_tensor(
    output: Any,
    input: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """Group rank i's ``output`` = the reduction of block i of every rank's ``input``
    (blocks concatenated along dim 0, or stacked)."""
    return tensors.reduce_scatter_tensor(resolve(group), output, input, op, async_op=async_op, timeout=timeout)


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """Rows of ``input`` (dim 0, ``input_split_sizes[j]`` for group rank j) to every rank;
    ``output`` gets ``output_split_sizes[i]`` rows from each group rank i. None: equal
    splits. See ``ProcessGroup.all_to_all_single``."""
    return resolve(group).all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, async_op=async_op, timeout=timeout
    )


def monitored_barrier(group: ProcessGroup | None = None, timeout: Timeout = None, wait_all_ranks: bool = False) -> None:
    """A barrier whose failure says who did not come: group rank 0 names the ranks that did
    not arrive within ``timeout`` (the first one, or all with ``wait_all_ranks=True``) and
    every rank raises. See ``ProcessGroup.monitored_barrier``."""
    resolve(group).monitored_barrier(timeout=timeout, wait_all_ranks=wait_all_ranks)


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
    *,
    timeout: Timeout = None,
) -> None:
    """Global rank ``src``'s (default 0, or group rank ``group_src``) picklable objects into
    ``object_list`` on every rank (a list of the same length everywhere). ``device`` is
    accepted and ignored: objects travel through host memory."""
    g = resolve(group)
    root = peer_rank(g, "broadcast_object_list", src, group_src, "src")
    objects.broadcast_object_list(g, object_list, g.group_rank(0) if root is None else root, timeout=timeout)


def all_gather_object(
    object_list: list[Any], obj: Any, group: ProcessGroup | None = None, *, timeout: Timeout = None
) -> None:
    """Every rank's picklable ``obj`` into ``object_list`` (one entry per rank, in rank
    order)."""
    objects.all_gather_object(resolve(group), object_list, obj, timeout=timeout)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> None:
    """Every rank's picklable ``obj`` into ``object_gather_list`` on global rank ``dst``
    (default 0, or group rank ``group_dst``); ``None`` elsewhere."""
    g = resolve(group)
    root = peer_rank(g, "gather_object", dst, group_dst, "dst")
    objects.gather_object(g, obj, object_gather_list, g.group_rank(0) if root is None else root, timeout=timeout)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    group_src: int | None = None,
    *,
    timeout: Timeout = None,
) -> None:
    """Entry i of ``scatter_object_input_list`` on global rank ``src`` (default 0, or group
    rank ``group_src``) into entry 0 of group rank i's ``scatter_object_output_list``."""
    g = resolve(group)
    root = peer_rank(g, "scatter_object_list", src, group_src, "src")
    objects.scatter_object_list(
        g,
        scatter_object_output_list,
        scatter_object_input_list,
        g.group_rank(0) if root is None else root,
        timeout=timeout,
    )


def enable_two_levels(
    group: ProcessGroup | None = None,
    *,
    places: Sequence[tuple[int, int]] | None = None,
    node_transport: Transport | None = None,
) -> str | None:
    """Run the world group's collectives over two levels: inside each node, then between
    nodes. ``init_process_group("auto")`` does this by itself for a job over several hosts;
    call it for a world made otherwise. A collective of every rank.

    Without arguments, the ranks find their nodes (the launchers' node numbers, else host
    names) and open each node's shared memory through the world's store. With ``places``
    (every rank's ``(node, local rank)``, the same list on every rank) and
    ``node_transport`` (this rank's transport to its node's ranks, as local rank of them:
    simulated nodes in tests), those are used. Returns the levels in words, or None where
    there is no second level (one node, or one rank per node: the world stays flat).

    Example (4 simulated ranks as 2 nodes of 2; ``inner[k]`` from
    ``SimulatedTransport.create_group(2)`` for node k)::

        enable_two_levels(places=[(0, 0), (0, 1), (1, 0), (1, 1)], node_transport=inner[rank // 2][rank % 2])
    """
    return levels.enable_given(resolve(group), places, node_transport)
