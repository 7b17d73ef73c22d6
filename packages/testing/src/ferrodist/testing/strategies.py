"""Hypothesis strategies for distributed tests: world sizes, dtypes, ops, tensors, roots, subgroups."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import strategies as st

from ferrodist.core import ALL_DTYPES, DType, ReduceOp, dtype

__all__ = [
    "dtypes",
    "picklable_objects",
    "reduce_ops",
    "roots",
    "shapes",
    "split_matrices",
    "subgroups",
    "tensors",
    "world_inputs",
    "world_sizes",
]


def world_sizes(min_size: int = 1, max_size: int = 8) -> st.SearchStrategy[int]:
    return st.integers(min_size, max_size)


def dtypes(kinds: Sequence[str] | None = None) -> st.SearchStrategy[DType]:
    """Every ferrodist dtype, or those of the given kinds (``"bool"``, ``"int"``, ``"uint"``, ``"float"``)."""
    chosen = [d for d in ALL_DTYPES if kinds is None or d.kind in kinds]
    return st.sampled_from(chosen)


def reduce_ops(dt: DType | str) -> st.SearchStrategy[ReduceOp]:
    """The reduce ops that apply to ``dt``."""
    return st.sampled_from(sorted(dtype(dt).ops, key=lambda op: op.value))


def shapes(max_elements: int = 64, max_dims: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """Array shapes from 0-d to ``max_dims`` dims, empty ones included, with at most ``max_elements`` elements."""

    def fits(shape: tuple[int, ...]) -> bool:
        return math.prod(shape) <= max_elements

    return st.lists(st.integers(0, max_elements), min_size=0, max_size=max_dims).map(tuple).filter(fits)


def _floats(dt: DType, low: float, high: float) -> st.SearchStrategy[float]:
    # Exactly representable values of the dtype: draw float32s and round them to the dtype.
    return st.floats(low, high, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False).map(
        lambda v: float(np.asarray(v, dtype=np.float32).astype(dt.numpy))
    )


def tensors(
    dt: DType | str, shape: tuple[int, ...], *, low: float = -1000.0, high: float = 1000.0
) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    """C-contiguous arrays of ``dt`` and ``shape``: integers over their whole range (so sums
    wrap around), bool at random, floats finite in ``[low, high]``."""
    dt = dtype(dt)
    count = math.prod(shape)
    if dt.kind == "bool":
        elements: st.SearchStrategy[Any] = st.booleans()
    elif dt.is_floating:
        elements = _floats(dt, low, high)
    else:
        info = np.iinfo(dt.numpy)
        elements = st.integers(int(info.min), int(info.max))
    return st.lists(elements, min_size=count, max_size=count).map(
        lambda values: (
            np.array(values, dtype=np.float64 if dt.is_floating else dt.numpy).astype(dt.numpy).reshape(shape)
        )
    )


def world_inputs(
    world_size: int, dt: DType | str, shape: tuple[int, ...], **bounds: float
) -> st.SearchStrategy[list[np.ndarray[Any, Any]]]:
    """One array per rank, all of ``dt`` and ``shape``."""
    return st.lists(tensors(dt, shape, **bounds), min_size=world_size, max_size=world_size)


def roots(world_size: int) -> st.SearchStrategy[int]:
    return st.integers(0, world_size - 1)


def subgroups(world_size: int) -> st.SearchStrategy[list[int]]:
    """Non-empty sorted subsets of the world's ranks."""
    return st.lists(st.integers(0, world_size - 1), min_size=1, max_size=world_size, unique=True).map(sorted)


def split_matrices(world_size: int, max_rows: int = 6) -> st.SearchStrategy[list[list[int]]]:
    """Rows each rank sends each rank in an ``all_to_all_single``: ``m[i][j]`` rows from
    rank i to rank j (zeros included), so rank i's ``input_split_sizes`` is ``m[i]`` and
    rank j's ``output_split_sizes`` is ``[m[i][j] for i]``."""
    row = st.lists(st.integers(0, max_rows), min_size=world_size, max_size=world_size)
    return st.lists(row, min_size=world_size, max_size=world_size)


def picklable_objects(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Python objects that pickle and compare equal after a round trip: None, bools,
    integers of any size, finite floats, text, bytes, and lists, tuples and dicts of them."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.binary(max_size=64),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.tuples(inner, inner),
            st.dictionaries(st.text(max_size=8), inner, max_size=4),
        ),
        max_leaves=max_leaves,
    )
