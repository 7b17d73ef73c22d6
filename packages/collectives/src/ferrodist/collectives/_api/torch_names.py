"""More of torch.distributed's names, as functions over the module-level calls and the
groups' public attributes: rank translation (``get_group_rank``, ``get_global_rank``,
``get_process_group_ranks``), objects point to point (``send_object_list``,
``recv_object_list``), ``new_subgroups``, and torch's newer names for the single-tensor
collectives (``all_gather_single``, ``reduce_scatter_single``).

``send_object_list`` sends two messages with ``send``: a header (how many objects, and
their total size in bytes, or which one could not be pickled), then every object's size
and the pickles as one uint8 array. The receiver takes both before it checks anything,
so a refused receive leaves no message behind for a later one.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from ferrodist.collectives._composed.objects import pickled
from ferrodist.collectives._group import ProcessGroup
from ferrodist.collectives._timeouts import Timeout
from ferrodist.collectives._work import Work
from ferrodist.core import InvalidArgument, InvalidRank, ProtocolError, ReduceOp
from ferrodist.transport import launch_info

from .calls import all_gather_into_tensor, recv, reduce_scatter_tensor, send
from .default_group import new_group, resolve

_INT64 = np.dtype(np.int64)


# -- ranks -------------------------------------------------------------------------------------
def get_group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """The rank in ``group`` of global rank ``global_rank`` (``InvalidRank`` when it is not a member).

    Example::

        sub = new_group([1, 3])
        get_group_rank(sub, 3)   # 1
    """
    return resolve(group).group_rank(global_rank)


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (``InvalidRank`` outside 0 .. size - 1).

    Example::

        sub = new_group([1, 3])
        get_global_rank(sub, 1)   # 3
    """
    g = resolve(group)
    if isinstance(group_rank, bool) or not isinstance(group_rank, (int, np.integer)) or not 0 <= group_rank < g.size:
        raise InvalidRank(
            f"rank {g.global_rank}: get_global_rank: group rank {group_rank!r} is not in group {g.name}, whose "
            f"ranks are 0 .. {g.size - 1} (global ranks {list(g.ranks)})",
            rank=g.global_rank,
            operation="get_global_rank",
        )
    return g.ranks[int(group_rank)]


def get_process_group_ranks(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group``'s members (the default group's when ``None``), in group-rank order.

    Example::

        get_process_group_ranks(new_group([3, 1]))   # [1, 3]
    """
    return list(resolve(group).ranks)


# -- torch's newer names -----------------------------------------------------------------------
def all_gather_single(
    output_tensor: Any,
    input_tensor: Any,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """torch's newer name for ``all_gather_into_tensor`` (the same call).

    Example::

        out = np.empty(2)
        all_gather_single(out, np.array([get_rank() * 1.0]))   # every rank: [0., 1.]
    """
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op, timeout=timeout)


def reduce_scatter_single(
    output: Any,
    input: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """torch's newer name for ``reduce_scatter_tensor`` (the same call).

    Example::

        out = np.empty(1)
        reduce_scatter_single(out, np.array([1.0, 2.0]))   # rank 0: [2.]  rank 1: [4.]
    """
    return reduce_scatter_tensor(output, input, op, group, async_op, timeout=timeout)


# -- subgroups ---------------------------------------------------------------------------------
def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    *,
    cuda_route: str | None = None,
) -> tuple[ProcessGroup, list[ProcessGroup]]:
    """Cut ``group`` (the default group when ``None``) into groups of ``group_size``
    consecutive ranks with ``new_group``; return the one this rank is in, and all of them.

    Without ``group_size``, a group per host: the launcher's ``LOCAL_WORLD_SIZE`` ranks
    (torch uses the number of GPUs per machine). Every rank of the world calls it, as
    ``new_group``; a rank outside ``group`` gets ``InvalidRank`` once the subgroups are made.
    ``timeout`` and ``cuda_route`` are ``new_group``'s.

    Example (4 ranks)::

        mine, every = new_subgroups(2)   # ranks 0, 1: mine.ranks == (0, 1)  ranks 2, 3: (2, 3)
        all_reduce(x, group=mine)
    """
    g = resolve(group)
    size = _subgroup_size(g, group_size)
    ranks = g.ranks
    subgroups = [
        new_group(ranks[start : start + size], timeout=timeout, cuda_route=cuda_route)
        for start in range(0, len(ranks), size)
    ]
    for sub in subgroups:
        if sub.is_member:
            return sub, subgroups
    raise InvalidRank(
        f"rank {g.global_rank}: new_subgroups: this rank is not in group {g.name} (members: {list(ranks)}), so it "
        "is in none of its subgroups; they are made (every rank of the world makes every group), but only members "
        "may use them",
        rank=g.global_rank,
        operation="new_subgroups",
    )


def _subgroup_size(g: ProcessGroup, group_size: int | None) -> int:
    where = f"rank {g.global_rank}: new_subgroups"
    if group_size is None:
        info = launch_info()
        if info is None or info.local_world_size is None:
            raise InvalidArgument(
                f"{where}: pass group_size (ranks per subgroup): without it the subgroups are the hosts, but no "
                "launcher said how many ranks run on this host (LOCAL_WORLD_SIZE)",
                rank=g.global_rank,
                operation="new_subgroups",
            )
        group_size = info.local_world_size
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size <= 0:
        raise InvalidArgument(
            f"{where}: group_size must be a positive integer, not {group_size!r}",
            rank=g.global_rank,
            operation="new_subgroups",
        )
    if g.size % group_size:
        raise InvalidArgument(
            f"{where}: group {g.name} has {g.size} ranks, which do not split into groups of {group_size}; "
            f"pass a group_size that divides {g.size}",
            rank=g.global_rank,
            operation="new_subgroups",
        )
    return int(group_size)


# -- objects point to point --------------------------------------------------------------------
def send_object_list(
    object_list: Sequence[Any],
    dst: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
    *,
    timeout: Timeout = None,
) -> None:
    """Send the picklable objects of ``object_list`` to global rank ``dst`` (or group rank
    ``group_dst``), where ``recv_object_list`` takes them into a list of the same length.

    An object that cannot be pickled raises ``InvalidArgument`` here and at the receiver,
    naming it. ``device`` and ``use_batch`` are accepted and ignored: the objects travel
    through host memory as two ``send`` messages. ``timeout`` bounds each of them.

    Example::

        if rank == 0:
            send_object_list(["foo", 12, {1: 2}], dst=1)
        else:
            objs = [None, None, None]
            recv_object_list(objs, src=0)   # objs == ['foo', 12, {1: 2}]
    """
    g = resolve(group)
    if not isinstance(object_list, Sequence) or isinstance(object_list, (str, bytes)):
        raise InvalidArgument(
            f"rank {g.global_rank}: send_object_list: object_list must be a list, not {type(object_list).__name__}",
            rank=g.global_rank,
            operation="send_object_list",
        )
    header = np.zeros(2, np.int64)  # [count, total bytes, or -1 - index of the object that failed]
    header[0] = len(object_list)
    parts: list[bytes] = []
    for index, obj in enumerate(object_list):
        data, failure = pickled(obj)
        if failure is not None:
            header[1] = -1 - index
            send(header, dst, group, 0, group_dst, timeout=timeout)  # the receiver raises too
            raise InvalidArgument(
                f"rank {g.global_rank}: send_object_list: object_list[{index}] cannot be pickled "
                f"({type(failure).__name__}: {failure}); nothing else was sent, the receiver raises too",
                rank=g.global_rank,
                operation="send_object_list",
            ) from failure
        parts.append(data)
    header[1] = sum(len(p) for p in parts)
    body = np.empty(len(parts) * _INT64.itemsize + int(header[1]), np.uint8)
    body[: len(parts) * _INT64.itemsize] = np.array([len(p) for p in parts], np.int64).view(np.uint8)
    body[len(parts) * _INT64.itemsize :] = np.frombuffer(b"".join(parts), np.uint8)
    send(header, dst, group, 0, group_dst, timeout=timeout)
    send(body, dst, group, 0, group_dst, timeout=timeout)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
    *,
    timeout: Timeout = None,
) -> int:
    """Replace the entries of ``object_list`` with the objects global rank ``src`` (or group
    rank ``group_src``; without either, the other rank of a group of two, as ``recv``)
    sent with ``send_object_list``; return the sender's global rank.

    The list must have as many entries as the sender's; where it does not, or the sender
    could not pickle an object, this raises ``InvalidArgument`` with the list left as it
    was and no message left behind. Bytes that do not unpickle raise ``ProtocolError``
    naming the sender. ``device`` and ``use_batch`` are accepted and ignored; ``timeout``
    bounds each of the two messages. ``pickle`` runs code: receive only from ranks you trust.
    """
    g = resolve(group)
    me = g.global_rank
    if not isinstance(object_list, list):
        raise InvalidArgument(
            f"rank {me}: recv_object_list: object_list must be a list, not {type(object_list).__name__}",
            rank=me,
            operation="recv_object_list",
        )
    header = np.zeros(2, np.int64)
    sender = recv(header, src, group, 0, group_src, timeout=timeout)
    count, total = int(header[0]), int(header[1])
    if total < 0:
        raise InvalidArgument(
            f"rank {me}: recv_object_list: object_list[{-1 - total}] on rank {sender} cannot be pickled (see that "
            "rank's error); nothing else was sent",
            rank=me,
            operation="recv_object_list",
        )
    body = np.empty(count * _INT64.itemsize + total, np.uint8)
    recv(body, sender, group, 0, timeout=timeout)  # the rest comes from the same rank
    if count != len(object_list):
        raise InvalidArgument(
            f"rank {me}: recv_object_list: rank {sender} sent {count} objects but object_list has "
            f"{len(object_list)} entries; pass a list as long as the sender's (the objects were received and "
            "dropped, the list is unchanged)",
            rank=me,
            operation="recv_object_list",
        )
    sizes = body[: count * _INT64.itemsize].view(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]) + count * _INT64.itemsize
    objects = []
    for i in range(count):
        try:
            objects.append(pickle.loads(body[offsets[i] : offsets[i + 1]].tobytes()))
        except Exception as exc:  # a class this process cannot import, a failing __setstate__
            raise ProtocolError(
                f"rank {me}: recv_object_list: object {i} from rank {sender} cannot be unpickled here "
                f"({type(exc).__name__}: {exc}); its class must be importable under the same name on every rank "
                "(the list is unchanged)",
                rank=me,
                operation="recv_object_list",
            ) from exc
    object_list[:] = objects
    return sender
