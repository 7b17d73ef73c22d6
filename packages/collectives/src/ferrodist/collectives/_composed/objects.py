"""Collectives of picklable Python objects: ``broadcast_object_list``, ``all_gather_object``,
``gather_object`` and ``scatter_object_list`` (group ranks here; the module-level
functions take global ones).

Each is a function over a group's public collectives, as torch builds them: two calls,
first the sizes of the pickled objects, then their bytes as one uint8 array, every
rank's padded to the largest so that all blocks are alike. The objects travel through
host memory on every backend.

An object that cannot be pickled is reported in the size step (a negative size), so
every rank of the call raises ``InvalidArgument`` naming the rank it belongs to, no
object bytes move, and the group stays usable. Bytes that do not unpickle raise
``ProtocolError`` on the rank that received them only, naming the rank they came from;
the output list is then left as it was.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrodist.collectives._call import Array
from ferrodist.collectives._checks import Checker, on_group
from ferrodist.collectives._timeouts import Timeout, seconds
from ferrodist.core import CollectiveMismatch, FerrodistError, ProtocolError

if TYPE_CHECKING:
    from ferrodist.collectives._group import ProcessGroup

_INT64 = np.dtype(np.int64)


def pickled(obj: object) -> tuple[bytes, BaseException | None]:
    """``obj``'s pickle, or ``(b"", the error)`` when it cannot be pickled."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # pickling runs arbitrary __reduce__ code: any error is the object's
        return b"", exc


def pickled_all(objects: list[Any]) -> tuple[list[bytes], int | None, BaseException | None]:
    """The pickles of ``objects``, in order, up to the first that fails: (pickles, the index
    of the one that failed or None, its error or None)."""
    parts: list[bytes] = []
    for index, obj in enumerate(objects):
        data, failure = pickled(obj)
        if failure is not None:
            return parts, index, failure
        parts.append(data)
    return parts, None, None


def unpickled(data: Array, source: int, check: Checker) -> Any:
    """The object pickled in ``data`` (uint8), sent by global rank ``source``."""
    try:
        return pickle.loads(data.tobytes())
    except Exception as exc:  # a class this process cannot import, corrupt bytes, a failing __setstate__
        raise check.fail(
            f"the object from rank {source} cannot be unpickled here ({type(exc).__name__}: {exc}); "
            "its class must be importable under the same name on every rank",
            ProtocolError,
        ) from exc


def checked(check: Checker, timeout: Timeout) -> float | None:
    """The caller's timeout, checked before the first step (None: the group's)."""
    return None if timeout is None else seconds(timeout, check.operation, rank=check.rank)


@contextlib.contextmanager
def step(check: Checker) -> Iterator[None]:
    """One of the group collectives an object collective is made of: its errors say which
    object collective it belongs to (a peer in another object collective is named by the
    collective it is in)."""
    try:
        yield
    except FerrodistError as exc:
        raise exc.with_context(f"rank {check.rank}: {check.operation}") from None


def padded(payload: bytes, width: int) -> Array:
    """``payload`` as a uint8 array of ``width`` bytes, zeros after it."""
    out = np.zeros(width, np.uint8)
    out[: len(payload)] = np.frombuffer(payload, np.uint8)
    return out


def refused(check: Checker, who: str, error: BaseException | None) -> FerrodistError:
    """The error every rank raises when ``who``'s object could not be pickled (``error``
    is the pickling error on the rank that hit it, None on the others)."""
    if error is not None:
        why = f"{type(error).__name__}: {error}"
        return check.fail(f"{who} cannot be pickled ({why}); no object was sent, every rank of the call raises")
    return check.fail(f"{who} cannot be pickled (see that rank's error); no object was sent, every rank raises")


def broadcast_object_list(
    group: ProcessGroup, object_list: list[Any], src: int = 0, *, timeout: Timeout = None
) -> None:
    """Replace the entries of ``object_list`` on every rank with group rank ``src``'s
    (pickled there, unpickled here). Every rank passes a list of the same length; on
    ``src`` it is left as it is.

    Example::

        objs = [{"lr": 0.1}, "run-7"] if rank == 0 else [None, None]
        broadcast_object_list(objs, src=0)   # every rank: [{'lr': 0.1}, 'run-7']
    """
    check = on_group(group, "broadcast_object_list")
    timeout = checked(check, timeout)
    root = check.root(src, group.size, "src")
    if not isinstance(object_list, list):
        raise check.fail(f"object_list must be a list, not {type(object_list).__name__}")
    count = len(object_list)
    header = np.zeros(2, np.int64)  # [entries, their pickles' bytes or -1 - index of one that failed]
    header[0] = count
    sizes = np.zeros(count, np.int64)
    parts: list[bytes] = []
    failure: BaseException | None = None
    me = group.rank
    if me == root:
        parts, failed, failure = pickled_all(object_list)
        sizes[: len(parts)] = [len(p) for p in parts]
        header[1] = sum(sizes) if failed is None else -1 - failed
    with step(check):
        group.broadcast(header, root, timeout=timeout)
    if header[1] < 0:
        raise refused(check, f"object_list[{-1 - header[1]}] on src rank {group.ranks[root]}", failure)
    if header[0] != count:
        error = check.fail(
            f"object_list has {count} entries here but src rank {group.ranks[root]} broadcasts {header[0]}; "
            "pass lists of one length on every rank",
            CollectiveMismatch,
        )
        group.abort(error)  # the others fail in the next step instead of waiting for this rank
        raise error
    payload = np.empty(sizes.nbytes + int(header[1]), np.uint8)  # the sizes, then the pickles
    if me == root:
        payload[: sizes.nbytes] = sizes.view(np.uint8)
        payload[sizes.nbytes :] = np.frombuffer(b"".join(parts), np.uint8)
    if payload.size:
        with step(check):
            group.broadcast(payload, root, timeout=timeout)
    if me == root:
        return
    sizes = payload[: sizes.nbytes].view(np.int64)
    offsets = sizes.nbytes + np.concatenate([[0], np.cumsum(sizes)])
    source = group.ranks[root]
    object_list[:] = [unpickled(payload[offsets[i] : offsets[i + 1]], source, check) for i in range(count)]


def all_gather_object(group: ProcessGroup, object_list: list[Any], obj: Any, *, timeout: Timeout = None) -> None:
    """Every rank's ``obj``, in group-rank order, into ``object_list`` (a list of group size).

    Example::

        out = [None] * group.size
        all_gather_object(out, {"rank": rank})   # every rank: [{'rank': 0}, {'rank': 1}]
    """
    check = on_group(group, "all_gather_object")
    timeout = checked(check, timeout)
    size = group.size
    output_list(check, object_list, "object_list", size)
    data, failure = pickled(obj)
    sizes = np.zeros(size, np.int64)
    with step(check):
        group.all_gather(sizes, np.array([-1 if failure is not None else len(data)], np.int64), timeout=timeout)
    check_pickles(check, group, sizes, failure)
    rows = np.zeros((size, int(sizes.max())), np.uint8)
    with step(check):
        group.all_gather(rows, padded(data, rows.shape[1]), timeout=timeout)
    object_list[:] = [unpickled(rows[i, : sizes[i]], group.ranks[i], check) for i in range(size)]


def gather_object(
    group: ProcessGroup, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, *, timeout: Timeout = None
) -> None:
    """Every rank's ``obj`` into ``object_gather_list`` on group rank ``dst`` (a list of
    group size there; ``None`` on the other ranks).

    Example::

        out = [None] * group.size if rank == 0 else None
        gather_object(rank * 10, out, dst=0)     # rank 0: out == [0, 10]
    """
    check = on_group(group, "gather_object")
    timeout = checked(check, timeout)
    size = group.size
    root = check.root(dst, size, "dst")
    me = group.rank
    if me == root:
        output_list(check, object_gather_list, "object_gather_list", size)
    elif object_gather_list:
        raise check.fail(
            f"object_gather_list is only used on the dst rank ({group.ranks[root]}); pass None on the others"
        )
    data, failure = pickled(obj)
    sizes = np.zeros(size, np.int64)
    with step(check):
        group.all_gather(sizes, np.array([-1 if failure is not None else len(data)], np.int64), timeout=timeout)
    check_pickles(check, group, sizes, failure)
    width = int(sizes.max())
    rows = np.zeros((size, width), np.uint8) if me == root else None
    with step(check):
        group.gather(padded(data, width), rows, root, timeout=timeout)
    if rows is not None and object_gather_list is not None:
        object_gather_list[:] = [unpickled(rows[i, : sizes[i]], group.ranks[i], check) for i in range(size)]


def scatter_object_list(
    group: ProcessGroup,
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    *,
    timeout: Timeout = None,
) -> None:
    """Group rank i receives entry i of ``scatter_object_input_list`` on group rank
    ``src`` (a list of group size there, ignored elsewhere) as the first entry of its
    ``scatter_object_output_list`` (a list of at least one entry).

    Example::

        inputs = ["a", "b"] if rank == 0 else None
        out = [None]
        scatter_object_list(out, inputs, src=0)   # rank 0: ['a']  rank 1: ['b']
    """
    check = on_group(group, "scatter_object_list")
    timeout = checked(check, timeout)
    size = group.size
    root = check.root(src, size, "src")
    output = scatter_object_output_list
    if not isinstance(output, list) or not output:
        raise check.fail(
            "scatter_object_output_list must be a list of at least one entry (the object lands in entry 0), "
            f"not {output!r}"
        )
    header = np.zeros(1, np.int64)  # the longest pickle, or -1 - index of one that failed
    parts: list[bytes] = []
    failure: BaseException | None = None
    me = group.rank
    if me == root:
        output_list(check, scatter_object_input_list, "scatter_object_input_list", size)
        assert scatter_object_input_list is not None
        parts, failed, failure = pickled_all(scatter_object_input_list)
        header[0] = max(len(p) for p in parts) if failed is None else -1 - failed
    with step(check):
        group.broadcast(header, root, timeout=timeout)
    if header[0] < 0:
        raise refused(check, f"scatter_object_input_list[{-1 - header[0]}] on src rank {group.ranks[root]}", failure)
    width = _INT64.itemsize + int(header[0])  # each block: the pickle's length, then the pickle
    mine = np.zeros(width, np.uint8)
    blocks = None
    if me == root:
        blocks = np.zeros((size, width), np.uint8)
        for i, data in enumerate(parts):
            blocks[i, : _INT64.itemsize] = np.array([len(data)], np.int64).view(np.uint8)
            blocks[i, _INT64.itemsize : _INT64.itemsize + len(data)] = np.frombuffer(data, np.uint8)
    with step(check):
        group.scatter(mine, blocks, root, timeout=timeout)
    length = int(mine[: _INT64.itemsize].view(np.int64)[0])
    output[0] = unpickled(mine[_INT64.itemsize : _INT64.itemsize + length], group.ranks[root], check)


def output_list(check: Checker, value: object, what: str, size: int) -> None:
    if not isinstance(value, list):
        raise check.fail(f"{what} must be a list of {size} entries (one per rank), not {type(value).__name__}")
    if len(value) != size:
        raise check.fail(f"{what} has {len(value)} entries but the group has {size} ranks; pass one per rank")


def check_pickles(check: Checker, group: ProcessGroup, sizes: Array, failure: BaseException | None) -> None:
    """Raise on every rank when some rank's object could not be pickled."""
    failed = [group.ranks[i] for i in np.flatnonzero(sizes < 0)]
    if failed:
        who = f"the object of rank {failed[0]}" if len(failed) == 1 else f"the objects of ranks {failed}"
        raise refused(check, who, failure)
