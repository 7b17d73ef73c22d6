"""Single-tensor collectives as torch names them: ``all_gather_into_tensor``,
``reduce_scatter_tensor`` and ``all_to_all_single`` (with uneven splits along dim 0).

The first two check torch's two output (input) layouts and run ``all_gather`` /
``reduce_scatter`` on the whole tensor, so they take the same routes (the transport's
own collectives on shm and mpi) and meet a peer calling those. ``all_to_all_single`` is
one call of two steps: the ranks first tell each peer how many rows they send it and
expect from it (and how long a row is), so a split that contradicts a peer's is named
on both ranks before any data moves; then the rows travel pairwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferrodist.core import CollectiveMismatch, ReduceOp, Tensor

from . import _direct
from ._call import Array, Call
from ._checks import Checker, device_blocks
from ._fingerprint import fingerprint
from ._runner import Runner
from ._timeouts import Timeout
from ._work import Work

#: Per peer, what all_to_all_single tells it: rows sent to it, rows expected from it, row length.
_SENDS, _EXPECTS, _ROW = 0, 1, 2


def layouts(part: Tensor, size: int) -> tuple[tuple[int, ...], ...]:
    """The shapes torch allows for a tensor holding ``size`` tensors shaped like ``part``:
    the concatenation along dim 0, and the stack ``(size, *part.shape)``."""
    stacked = (size, *part.shape)
    if not part.shape:
        return (stacked,)
    return ((size * part.shape[0], *part.shape[1:]), stacked)


def check_layout(check: Checker, whole: Tensor, part: Tensor, size: int, whole_name: str, part_name: str) -> None:
    if whole.dtype is not part.dtype:
        raise check.fail(f"{whole_name} is {whole.dtype.name} but {part_name} is {part.dtype.name}; use one dtype")
    allowed = layouts(part, size)
    if whole.shape not in allowed:
        forms = " or ".join(str(s) for s in allowed)
        raise check.fail(
            f"{whole_name} has shape {whole.shape}, but with {part_name} of shape {part.shape} on {size} ranks "
            f"it must be {forms} (the {part_name}s concatenated along dim 0, or stacked)"
        )


def split_sizes(check: Checker, splits: object, rows: int, size: int, what: str, tensor_name: str) -> list[int]:
    """Rows per rank along dim 0: ``splits`` checked, or equal blocks when it is None."""
    if splits is None:
        if rows % size:
            raise check.fail(
                f"{tensor_name} has {rows} rows along dim 0, which do not split equally over {size} ranks; pass {what}"
            )
        return [rows // size] * size
    try:
        values = list(splits)  # type: ignore[call-overload]
    except TypeError:
        raise check.fail(f"{what} must be a list of {size} row counts, not {splits!r}") from None
    if len(values) != size or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in values):
        raise check.fail(f"{what} must be {size} non-negative integers (one per rank), not {values!r}")
    counts = [int(v) for v in values]
    if sum(counts) != rows:
        raise check.fail(
            f"{what} {counts} add up to {sum(counts)} rows but {tensor_name} has {rows} rows along dim 0; "
            "they must be equal"
        )
    return counts


def pieces(flat: Any, counts: Sequence[int], row: int) -> list[Any]:
    """Consecutive views of ``flat`` of ``counts[i] * row`` elements each."""
    out, start = [], 0
    for count in counts:
        out.append(flat[start : start + count * row])
        start += count * row
    return out


def contradictions(mine: Array, theirs: Array, rank: int, ranks: Sequence[int]) -> list[str]:
    """What each peer told this rank (``theirs[i]``) that does not fit what this rank
    tells it (``mine[i]``), in words."""
    found = []
    for i, (m, t) in enumerate(zip(mine, theirs, strict=True)):
        if i == rank:
            continue
        peer = f"rank {ranks[i]}" + (f" (group rank {i})" if ranks[i] != i else "")
        if t[_ROW] != m[_ROW]:
            found.append(f"{peer} has rows of {t[_ROW]} elements, this rank of {m[_ROW]}")
            continue
        if t[_SENDS] != m[_EXPECTS]:
            found.append(
                f"output_split_sizes[{i}] here is {m[_EXPECTS]} rows but {peer} sends {t[_SENDS]} "
                f"(its input_split_sizes[{rank}])"
            )
        if t[_EXPECTS] != m[_SENDS]:
            found.append(
                f"input_split_sizes[{i}] here is {m[_SENDS]} rows but {peer} expects {t[_EXPECTS]} "
                f"(its output_split_sizes[{rank}])"
            )
    return found


class TensorCollectives:
    """Torch's single-tensor collectives on ``ProcessGroup`` (a mixin over the group's
    collectives, checks, route and runner)."""

    _runner: Runner
    _ranks: tuple[int, ...]
    _rank: int | None
    _global_rank: int

    def _checker(self, operation: str) -> Checker:
        raise NotImplementedError

    def _route(
        self,
        operation: str,
        tensors: Sequence[Tensor],
        op: ReduceOp | None = None,
        algorithm: str | None = None,
        nbytes: int = 0,
    ) -> tuple[Any, Any]:
        raise NotImplementedError

    def all_gather(self, output: Any, tensor: Any, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        raise NotImplementedError

    def reduce_scatter(
        self,
        output: Any,
        input: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        raise NotImplementedError

    def all_gather_into_tensor(
        self, output_tensor: Any, input_tensor: Any, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """Every rank's ``input_tensor`` into ``output_tensor``, in group-rank order: the
        inputs concatenated along dim 0 (``(size * n, ...)``) or stacked (``(size, n, ...)``).

        Example::

            out = np.empty((2, 3))
            group.all_gather_into_tensor(out, np.full(3, rank * 1.0))   # every rank: [[0, 0, 0], [1, 1, 1]]
        """
        check = self._checker("all_gather_into_tensor")
        part = check.tensor(input_tensor, "input_tensor")
        whole = check.tensor(output_tensor, "output_tensor", writeable=True)
        check_layout(check, whole, part, len(self._ranks), "output_tensor", "input_tensor")
        return self.all_gather(output_tensor, input_tensor, async_op=async_op, timeout=timeout)

    def reduce_scatter_tensor(
        self,
        output: Any,
        input: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Group rank i's ``output`` = the reduction over ranks of block i of their ``input``:
        ``input`` is the blocks concatenated along dim 0 (``(size * n, ...)``) or stacked
        (``(size, n, ...)``); it is not modified.

        Example::

            out = np.empty(1)
            group.reduce_scatter_tensor(out, np.array([1.0, 2.0]))   # rank 0: [2.]  rank 1: [4.]
        """
        check = self._checker("reduce_scatter_tensor")
        part = check.tensor(output, "output", writeable=True)
        whole = check.tensor(input, "input")
        check_layout(check, whole, part, len(self._ranks), "input", "output")
        return self.reduce_scatter(output, input, op, async_op=async_op, timeout=timeout)

    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Split ``input`` along dim 0 into ``input_split_sizes[j]`` rows for group rank j, and
        fill ``output`` with ``output_split_sizes[i]`` rows from each group rank i, in rank
        order. A split left as None means equal blocks. Rank i's ``input_split_sizes[j]``
        must equal rank j's ``output_split_sizes[i]``; where it does not, both ranks raise
        ``CollectiveMismatch`` naming the other before any row moves (the others raise too).

        Example (2 ranks)::

            x = np.arange(3.0) + 10 * rank          # rank 0: [0, 1, 2]     rank 1: [10, 11, 12]
            ins = [1, 2] if rank == 0 else [2, 1]   # rows for rank 0, rows for rank 1
            outs = [1, 2] if rank == 0 else [2, 1]  # rows from rank 0, rows from rank 1
            out = np.empty(3)
            group.all_to_all_single(out, x, outs, ins)   # rank 0: [0, 10, 11]  rank 1: [1, 2, 12]
        """
        check = self._checker("all_to_all_single")
        size = len(self._ranks)
        out_t = check.tensor(output, "output", writeable=True)
        in_t = check.tensor(input, "input")
        if out_t.dtype is not in_t.dtype:
            raise check.fail(f"output is {out_t.dtype.name} but input is {in_t.dtype.name}; use one dtype")
        if not out_t.shape or not in_t.shape:
            raise check.fail("output and input need at least one dimension: they are split along dim 0")
        if out_t.shape[1:] != in_t.shape[1:]:
            raise check.fail(
                f"output has shape {out_t.shape} and input {in_t.shape}: they must agree past dim 0 (rows alike)"
            )
        row = math.prod(in_t.shape[1:])
        sends = split_sizes(check, input_split_sizes, in_t.shape[0], size, "input_split_sizes", "input")
        expects = split_sizes(check, output_split_sizes, out_t.shape[0], size, "output_split_sizes", "output")
        me = self._rank
        assert me is not None  # the checker made sure
        if sends[me] != expects[me]:
            raise check.fail(
                f"input_split_sizes[{me}] is {sends[me]} rows but output_split_sizes[{me}] is {expects[me]}: "
                "the rows this rank sends itself must fill what it expects from itself"
            )
        told = np.zeros((size, 3), np.int64)
        told[:, _SENDS], told[:, _EXPECTS], told[:, _ROW] = sends, expects, row
        heard = np.zeros_like(told)
        outs, ins = pieces(out_t.flat(), expects, row), pieces(in_t.flat(), sends, row)
        dev, _ = self._route("all_to_all_single", [out_t, in_t])  # no transport has its own all_to_all
        if dev is not None:
            out_blocks, in_blocks = device_blocks(outs, out_t.dtype), device_blocks(ins, in_t.dtype)
        ranks = self._ranks

        def body(call: Call) -> None:
            _direct.all_to_all(call, list(heard), list(told))
            wrong = contradictions(told, heard, call.rank, ranks)
            if wrong:
                raise CollectiveMismatch(
                    f"the splits disagree with the peers': {'; '.join(wrong)}. Rank i's input_split_sizes[j] "
                    "must equal rank j's output_split_sizes[i], with rows of one length on every rank",
                    rank=ranks[call.rank],
                    operation="all_to_all_single",
                )
            if dev is not None:
                dev.all_to_all(call, out_blocks, in_blocks)
            else:
                _direct.all_to_all(call, outs, ins)

        fp = fingerprint("all_to_all_single", in_t.dtype, direct=dev is not None and dev.direct)
        return self._runner.launch("all_to_all_single", body, fp, async_op=async_op, timeout=timeout)
