"""Collectives of picklable Python objects: ``broadcast_object_list``, ``all_gather_object``,
``gather_object`` and ``scatter_object_list`` (group ranks here; ``_api_torch`` takes global ones).

Each is one call on its group (one call number, one fingerprint, run in its turn like any
other), made of two steps over the transport: first the sizes of the pickled objects,
then their bytes as one uint8 array, every rank's padded to the largest so that all
blocks are alike. The objects travel through host memory on every backend.

An object that cannot be pickled is reported in the size step (a negative size), so
every rank of the call raises ``InvalidArgument`` naming the rank it belongs to, no
object bytes move, and the group stays usable. Bytes that do not unpickle raise
``ProtocolError`` on the rank that received them only, naming the rank they came from;
the output list is then left as it was.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ferrodist.core import FerrodistError, ProtocolError

from . import _direct, _ring, _tree
from ._call import Array, Call
from ._checks import Checker
from ._fingerprint import fingerprint
from ._runner import Runner
from ._timeouts import Timeout

_INT64 = np.dtype(np.int64)


def pickled(obj: object) -> tuple[bytes, BaseException | None]:
    """``obj``'s pickle, or ``(b"", the error)`` when it cannot be pickled."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # pickling runs arbitrary __reduce__ code: any error is the object's
        return b"", exc


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


def exchange_sizes(call: Call, sizes: Array) -> int | None:
    """Fill ``sizes`` (int64, one per rank; ours already set) from every rank; the largest,
    or None when one is negative (that rank could not pickle its object)."""
    _ring.all_gather(call, [sizes[i : i + 1] for i in range(call.size)])
    return None if (sizes < 0).any() else int(sizes.max())


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


class ObjectCollectives:
    """The object collectives of ``ProcessGroup`` (a mixin over the group's checks and runner)."""

    _runner: Runner
    _ranks: tuple[int, ...]
    _rank: int | None
    _global_rank: int

    def _checker(self, operation: str) -> Checker:
        raise NotImplementedError

    def broadcast_object_list(self, object_list: list[Any], src: int = 0, *, timeout: Timeout = None) -> None:
        """Replace the entries of ``object_list`` on every rank with group rank ``src``'s
        (pickled there, unpickled here). Every rank passes a list of the same length; on
        ``src`` it is left as it is.

        Example::

            objs = [{"lr": 0.1}, "run-7"] if rank == 0 else [None, None]
            group.broadcast_object_list(objs, src=0)   # every rank: [{'lr': 0.1}, 'run-7']
        """
        check = self._checker("broadcast_object_list")
        root = check.root(src, len(self._ranks), "src")
        if not isinstance(object_list, list):
            raise check.fail(f"object_list must be a list, not {type(object_list).__name__}")
        count = len(object_list)
        header = np.zeros(1 + count, np.int64)  # [total bytes, or -1 - index of a failed pickle; sizes]
        parts: list[bytes] = []
        failure: BaseException | None = None
        if self._rank == root:
            for index, obj in enumerate(object_list):
                data, failure = pickled(obj)
                if failure is not None:
                    header[0] = -1 - index
                    break
                parts.append(data)
                header[1 + index] = len(data)
            else:
                header[0] = sum(header[1:])
        received: list[Array] = []

        def body(call: Call) -> None:
            _tree.broadcast(call, header, root)
            if header[0] < 0:
                return
            payload = np.frombuffer(b"".join(parts), np.uint8) if call.rank == root else np.empty(header[0], np.uint8)
            _tree.broadcast(call, payload, root)
            received.append(payload)

        fp = fingerprint("broadcast_object_list", count=count, root=root)
        self._runner.launch("broadcast_object_list", body, fp, async_op=False, timeout=timeout)
        if header[0] < 0:
            raise refused(check, f"object_list[{-1 - header[0]}] on src rank {self._ranks[root]}", failure)
        if self._rank == root:
            return
        offsets = np.concatenate([[0], np.cumsum(header[1:])])
        payload = received[0]
        source = self._ranks[root]
        objects = [unpickled(payload[offsets[i] : offsets[i + 1]], source, check) for i in range(count)]
        object_list[:] = objects

    def all_gather_object(self, object_list: list[Any], obj: Any, *, timeout: Timeout = None) -> None:
        """Every rank's ``obj``, in group-rank order, into ``object_list`` (a list of group size).

        Example::

            out = [None] * group.size
            group.all_gather_object(out, {"rank": rank})   # every rank: [{'rank': 0}, {'rank': 1}]
        """
        check = self._checker("all_gather_object")
        size = len(self._ranks)
        self._output_list(check, object_list, "object_list", size)
        data, failure = pickled(obj)
        sizes = np.zeros(size, np.int64)
        sizes[self._rank] = -1 if failure is not None else len(data)
        found: list[Array] = []

        def body(call: Call) -> None:
            width = exchange_sizes(call, sizes)
            if width is not None:
                rows = np.zeros((call.size, width), np.uint8)
                rows[call.rank, : len(data)] = np.frombuffer(data, np.uint8)
                _ring.all_gather(call, list(rows))
                found.append(rows)

        self._runner.launch(
            "all_gather_object", body, fingerprint("all_gather_object"), async_op=False, timeout=timeout
        )
        self._check_pickles(check, sizes, failure)
        rows = found[0]
        object_list[:] = [unpickled(rows[i, : sizes[i]], self._ranks[i], check) for i in range(size)]

    def gather_object(
        self, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, *, timeout: Timeout = None
    ) -> None:
        """Every rank's ``obj`` into ``object_gather_list`` on group rank ``dst`` (a list of
        group size there; ``None`` on the other ranks).

        Example::

            out = [None] * group.size if rank == 0 else None
            group.gather_object(rank * 10, out, dst=0)     # rank 0: out == [0, 10]
        """
        check = self._checker("gather_object")
        size = len(self._ranks)
        root = check.root(dst, size, "dst")
        if self._rank == root:
            self._output_list(check, object_gather_list, "object_gather_list", size)
        elif object_gather_list:
            raise check.fail(
                f"object_gather_list is only used on the dst rank ({self._ranks[root]}); pass None on the others"
            )
        data, failure = pickled(obj)
        sizes = np.zeros(size, np.int64)
        sizes[self._rank] = -1 if failure is not None else len(data)
        found: list[Array] = []

        def body(call: Call) -> None:
            width = exchange_sizes(call, sizes)
            if width is None:
                return
            mine = padded(data, width)
            rows = np.zeros((call.size, width), np.uint8) if call.rank == root else None
            _direct.gather(call, mine, list(rows) if rows is not None else None, root)
            found.append(rows if rows is not None else mine)

        fp = fingerprint("gather_object", root=root)
        self._runner.launch("gather_object", body, fp, async_op=False, timeout=timeout)
        self._check_pickles(check, sizes, failure)
        if self._rank == root and object_gather_list is not None:
            rows = found[0]
            objects = [unpickled(rows[i, : sizes[i]], self._ranks[i], check) for i in range(size)]
            object_gather_list[:] = objects

    def scatter_object_list(
        self,
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
            group.scatter_object_list(out, inputs, src=0)   # rank 0: ['a']  rank 1: ['b']
        """
        check = self._checker("scatter_object_list")
        size = len(self._ranks)
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
        if self._rank == root:
            self._output_list(check, scatter_object_input_list, "scatter_object_input_list", size)
            assert scatter_object_input_list is not None
            for index, obj in enumerate(scatter_object_input_list):
                data, failure = pickled(obj)
                if failure is not None:
                    header[0] = -1 - index
                    break
                parts.append(data)
            else:
                header[0] = max(len(p) for p in parts)
        received: list[Array] = []

        def body(call: Call) -> None:
            _tree.broadcast(call, header, root)
            if header[0] < 0:
                return
            width = _INT64.itemsize + int(header[0])  # each block: the pickle's length, then the pickle
            mine = np.zeros(width, np.uint8)
            blocks = None
            if call.rank == root:
                blocks = np.zeros((call.size, width), np.uint8)
                for i, data in enumerate(parts):
                    blocks[i, : _INT64.itemsize] = np.array([len(data)], np.int64).view(np.uint8)
                    blocks[i, _INT64.itemsize : _INT64.itemsize + len(data)] = np.frombuffer(data, np.uint8)
            _direct.scatter(call, mine, list(blocks) if blocks is not None else None, root)
            received.append(mine)

        fp = fingerprint("scatter_object_list", root=root)
        self._runner.launch("scatter_object_list", body, fp, async_op=False, timeout=timeout)
        if header[0] < 0:
            raise refused(
                check, f"scatter_object_input_list[{-1 - header[0]}] on src rank {self._ranks[root]}", failure
            )
        mine = received[0]
        length = int(mine[: _INT64.itemsize].view(np.int64)[0])
        output[0] = unpickled(mine[_INT64.itemsize : _INT64.itemsize + length], self._ranks[root], check)

    # -- helpers -----------------------------------------------------------------------------------
    def _output_list(self, check: Checker, value: object, what: str, size: int) -> None:
        if not isinstance(value, list):
            raise check.fail(f"{what} must be a list of {size} entries (one per rank), not {type(value).__name__}")
        if len(value) != size:
            raise check.fail(f"{what} has {len(value)} entries but the group has {size} ranks; pass one per rank")

    def _check_pickles(self, check: Checker, sizes: Array, failure: BaseException | None) -> None:
        """Raise on every rank when some rank's object could not be pickled."""
        failed = [self._ranks[i] for i in np.flatnonzero(sizes < 0)]
        if failed:
            who = f"the object of rank {failed[0]}" if len(failed) == 1 else f"the objects of ranks {failed}"
            raise refused(check, who, failure)
