"""Naive numpy references of every collective, and the tolerance to compare floats with.

Each reference takes what every rank passed (a list indexed by rank) and returns what
every rank should hold afterwards (a list indexed by rank). They are written to be
obviously right, not fast: floating reductions are done in float64, integer ones in
the dtype itself (wrapping around exactly as the kernels do).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ferrodist.core import ReduceOp, dtype

__all__ = [
    "assert_reduced",
    "reduce_values",
    "ref_all_gather",
    "ref_all_gather_into_tensor",
    "ref_all_gather_object",
    "ref_all_reduce",
    "ref_all_to_all",
    "ref_all_to_all_single",
    "ref_broadcast",
    "ref_broadcast_object_list",
    "ref_gather",
    "ref_gather_object",
    "ref_reduce",
    "ref_reduce_scatter",
    "ref_reduce_scatter_tensor",
    "ref_scatter",
    "ref_scatter_object_list",
    "reduction_tolerance",
]

Array = np.ndarray[Any, Any]

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
_BOOL_UFUNCS = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.MIN: np.logical_and,
}


def reduce_values(values: Sequence[Array], op: ReduceOp | str) -> Array:
    """The element-wise reduction of ``values`` (one array per rank), in their dtype."""
    op = ReduceOp.coerce(op)
    dt = dtype(values[0].dtype)
    with np.errstate(all="ignore"):
        if dt.is_floating:
            wide = [np.asarray(v, dtype=np.float64) for v in values]
            out = functools.reduce(_UFUNCS[op], wide)
            if op is ReduceOp.AVG:
                out = out / len(values)
            return out.astype(dt.numpy)
        if dt.kind == "bool":
            return functools.reduce(_BOOL_UFUNCS.get(op, _UFUNCS[op]), values).astype(np.bool_)
        return functools.reduce(_UFUNCS[op], values).astype(dt.numpy)


def reduction_tolerance(values: Sequence[Array], op: ReduceOp | str) -> Array:
    """Per-element bound on |ferrodist - reference| for a floating reduction of ``values``.

    With u the unit roundoff of the dtype and k ranks: SUM may differ by
    2(k+1)·u·Σ|x_i| (each of the k-1 partial results and the final one rounds once, in
    any order); AVG by that over k; PRODUCT by 2(k+1)·u·|Π x_i| plus k smallest
    normals for underflow; MIN and MAX must match exactly.
    """
    op = ReduceOp.coerce(op)
    dt = dtype(values[0].dtype)
    k = len(values)
    if not dt.is_floating or op in (ReduceOp.MIN, ReduceOp.MAX):
        return np.zeros(np.shape(values[0]))
    info = ml_dtypes.finfo(dt.numpy)  # numpy's finfo does not know bfloat16
    unit = float(info.eps) / 2
    tiny = float(info.smallest_normal)
    wide = [np.abs(np.asarray(v, dtype=np.float64)) for v in values]
    if op is ReduceOp.PRODUCT:
        return 2 * (k + 1) * unit * functools.reduce(np.multiply, wide) + k * tiny
    bound = 2 * (k + 1) * unit * functools.reduce(np.add, wide) + tiny
    return bound / k if op is ReduceOp.AVG else bound


def assert_reduced(got: Array, values: Sequence[Array], op: ReduceOp | str, *, what: str = "result") -> None:
    """Assert ``got`` is the reduction of ``values``: exact for integers, bool, MIN and MAX;
    within :func:`reduction_tolerance` for floating SUM, AVG and PRODUCT."""
    op = ReduceOp.coerce(op)
    expected = reduce_values(values, op)
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(f"{what}: got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}")
    dt = dtype(got.dtype)
    if not dt.is_floating or op in (ReduceOp.MIN, ReduceOp.MAX):
        np.testing.assert_array_equal(got, expected, err_msg=f"{what} ({op.name}, {dt.name})")
        return
    wide_got = got.astype(np.float64)
    wide_exp = expected.astype(np.float64)
    error = np.abs(wide_got - wide_exp)
    bound = reduction_tolerance(values, op)
    same_special = (np.isnan(wide_got) & np.isnan(wide_exp)) | (np.isinf(wide_exp) & (wide_got == wide_exp))
    bad = ~(error <= bound) & ~same_special
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[0]
        raise AssertionError(
            f"{what} ({op.name}, {dt.name}): element {i} is {wide_got.reshape(-1)[i]!r}, reference "
            f"{wide_exp.reshape(-1)[i]!r}, error {error.reshape(-1)[i]:.3g} > bound {np.reshape(bound, -1)[i]:.3g} "
            f"({int(bad.sum())} of {bad.size} elements out of bounds)"
        )


def ref_all_reduce(inputs: Sequence[Array], op: ReduceOp | str) -> list[Array]:
    result = reduce_values(inputs, op)
    return [result.copy() for _ in inputs]


def ref_broadcast(inputs: Sequence[Array], src: int) -> list[Array]:
    return [inputs[src].copy() for _ in inputs]


def ref_reduce(inputs: Sequence[Array], dst: int, op: ReduceOp | str) -> list[Array]:
    return [reduce_values(inputs, op) if r == dst else x.copy() for r, x in enumerate(inputs)]


def ref_all_gather(inputs: Sequence[Array]) -> list[list[Array]]:
    return [[x.copy() for x in inputs] for _ in inputs]


def ref_reduce_scatter(blocks: Sequence[Sequence[Array]], op: ReduceOp | str) -> list[Array]:
    """``blocks[r][i]`` is rank r's input block for rank i."""
    return [reduce_values([blocks[r][i] for r in range(len(blocks))], op) for i in range(len(blocks))]


def ref_gather(inputs: Sequence[Array], dst: int) -> list[list[Array] | None]:
    return [[x.copy() for x in inputs] if r == dst else None for r in range(len(inputs))]


def ref_scatter(blocks: Sequence[Array], src: int, world_size: int) -> list[Array]:
    """``blocks`` is the root's scatter list."""
    return [blocks[r].copy() for r in range(world_size)]


def ref_all_to_all(inputs: Sequence[Sequence[Array]]) -> list[list[Array]]:
    """``inputs[r][j]`` is what rank r sends to rank j; rank j ends with ``[inputs[i][j] for i]``."""
    size = len(inputs)
    return [[inputs[i][j].copy() for i in range(size)] for j in range(size)]


def ref_all_gather_into_tensor(inputs: Sequence[Array], *, stacked: bool = False) -> list[Array]:
    """Every rank's output: the inputs concatenated along dim 0, or stacked (``(size, *shape)``)."""
    whole = np.stack(inputs) if stacked or np.ndim(inputs[0]) == 0 else np.concatenate(inputs)
    return [whole.copy() for _ in inputs]


def ref_reduce_scatter_tensor(inputs: Sequence[Array], op: ReduceOp | str, *, stacked: bool = False) -> list[Array]:
    """Rank i's output: the reduction of block i of every rank's input, the blocks being
    consecutive equal slices along dim 0 (``stacked=False``) or the entries along dim 0."""
    size = len(inputs)
    if stacked:
        blocks = [[x[i] for i in range(size)] for x in inputs]
    else:
        rows = np.shape(inputs[0])[0] // size
        blocks = [[x[i * rows : (i + 1) * rows] for i in range(size)] for x in inputs]
    return ref_reduce_scatter(blocks, op)


def ref_all_to_all_single(inputs: Sequence[Array], input_splits: Sequence[Sequence[int]]) -> list[Array]:
    """``inputs[i]`` is rank i's input; its first ``input_splits[i][0]`` rows go to rank 0,
    the next ``input_splits[i][1]`` to rank 1, and so on. Rank j's output: the rows every
    rank i sent it, in rank order."""
    size = len(inputs)
    parts = []
    for i in range(size):
        starts = np.concatenate([[0], np.cumsum(input_splits[i])]).astype(int)
        parts.append([inputs[i][starts[j] : starts[j + 1]] for j in range(size)])
    return [np.concatenate([parts[i][j] for i in range(size)]) for j in range(size)]


def ref_all_gather_object(objects: Sequence[Any]) -> list[list[Any]]:
    """Every rank's ``object_list``: every rank's object, in rank order."""
    return [list(objects) for _ in objects]


def ref_broadcast_object_list(object_lists: Sequence[Sequence[Any]], src: int) -> list[list[Any]]:
    """Every rank's ``object_list``: ``src``'s."""
    return [list(object_lists[src]) for _ in object_lists]


def ref_gather_object(objects: Sequence[Any], dst: int) -> list[list[Any] | None]:
    """``dst``'s ``object_gather_list``: every rank's object; None on the others."""
    return [list(objects) if r == dst else None for r in range(len(objects))]


def ref_scatter_object_list(inputs: Sequence[Any], src: int, world_size: int) -> list[list[Any]]:
    """Every rank's ``scatter_object_output_list`` (of one entry): entry r of ``src``'s inputs."""
    return [[inputs[r]] for r in range(world_size)]
