"""The rows of ``ProcessGroup.all_to_all_single``: uneven splits along dim 0.

The call has two steps: the ranks first tell each peer how many rows they send it and
expect from it (and how long a row is), so a split that contradicts a peer's is named on
both ranks before any data moves; then the rows travel pairwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferrodist.core import CollectiveMismatch

from ._algorithms import direct
from ._call import Array, Call
from ._checks import Checker, device_blocks

__all__ = ["Rows"]

#: Per peer, what all_to_all_single tells it: rows sent to it, rows expected from it, row length.
_SENDS, _EXPECTS, _ROW = 0, 1, 2


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


class Rows:
    """The checked arguments of one ``all_to_all_single``: the rows this rank sends each
    peer and expects from it, and the first step of the call that compares them."""

    def __init__(
        self,
        check: Checker,
        output: Any,
        input: Any,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
        ranks: Sequence[int],
        me: int,
    ) -> None:
        size = len(ranks)
        self.output = out_t = check.tensor(output, "output", writeable=True)
        self.input = in_t = check.tensor(input, "input")
        if out_t.dtype is not in_t.dtype:
            raise check.fail(f"output is {out_t.dtype.name} but input is {in_t.dtype.name}; use one dtype")
        if not out_t.shape or not in_t.shape:
            raise check.fail("output and input need at least one dimension: they are split along dim 0")
        if out_t.shape[1:] != in_t.shape[1:]:
            raise check.fail(
                f"output has shape {out_t.shape} and input {in_t.shape}: they must agree past dim 0 (rows alike)"
            )
        self.row = math.prod(in_t.shape[1:])
        self.sends = split_sizes(check, input_split_sizes, in_t.shape[0], size, "input_split_sizes", "input")
        self.expects = split_sizes(check, output_split_sizes, out_t.shape[0], size, "output_split_sizes", "output")
        if self.sends[me] != self.expects[me]:
            raise check.fail(
                f"input_split_sizes[{me}] is {self.sends[me]} rows but output_split_sizes[{me}] is "
                f"{self.expects[me]}: the rows this rank sends itself must fill what it expects from itself"
            )
        self.ranks = tuple(ranks)
        self.told = np.zeros((size, 3), np.int64)
        self.told[:, _SENDS], self.told[:, _EXPECTS], self.told[:, _ROW] = self.sends, self.expects, self.row
        self.heard = np.zeros_like(self.told)

    def blocks(self, *, device: bool) -> tuple[list[Any], list[Any]]:
        """The output's and the input's pieces per peer: flat host arrays, or device tensors."""
        outs = pieces(self.output.flat(), self.expects, self.row)
        ins = pieces(self.input.flat(), self.sends, self.row)
        if device:
            return device_blocks(outs, self.output.dtype), device_blocks(ins, self.input.dtype)
        return outs, ins

    def agree(self, call: Call) -> None:
        """The call's first step: every pair compares its splits; a contradiction raises
        ``CollectiveMismatch`` on both ranks before any row moves."""
        direct.all_to_all(call, list(self.heard), list(self.told))
        wrong = contradictions(self.told, self.heard, call.rank, self.ranks)
        if wrong:
            raise CollectiveMismatch(
                f"the splits disagree with the peers': {'; '.join(wrong)}. Rank i's input_split_sizes[j] "
                "must equal rank j's output_split_sizes[i], with rows of one length on every rank",
                rank=self.ranks[call.rank],
                operation="all_to_all_single",
            )
