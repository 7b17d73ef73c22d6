"""CUDA kernels that move a group's arrays into and out of one flat bucket (private):
``pack`` and ``unpack``, one launch per :data:`MAX_ARRAYS_PER_LAUNCH` arrays.

The kernels are generated per arity from a template and cached; launching, validation and
the grid come from ``_cuda_kernels``.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferrodist.core import InvalidArgument

from ._cuda_device import MAX_ARRAYS_PER_LAUNCH, MAX_BLOCKS, THREADS_PER_BLOCK, launch
from ._cuda_kernels import _flat

__all__ = ["pack", "unpack"]

# One pack/unpack kernel per arity (a power of two). ``table`` holds three rows of
# ``arity`` int64: each array's start in the bucket, its length, and its start in the flat
# index space of all the launch's elements. Thread t moves flat elements t, t + stride, ...,
# so the work is spread evenly however long each array is, and each array's elements are
# read and written by consecutive threads (coalesced).
_MOVE_HEADER = """\
def {name}(bucket, table, {arrays}):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
"""
_MOVE_STEP = """\
    offset = table[{j}]
    for i in range((start - table[{flat}]) % stride, table[{length}], stride):
        {statement}
"""


@functools.cache
def _move_kernel(direction: str, arity: int) -> Any:
    """The pack (``"pack"``) or unpack kernel for ``arity`` arrays, generated from a template."""
    from numba import cuda

    arrays = ", ".join(f"a{j}" for j in range(arity))
    source = _MOVE_HEADER.format(name=f"{direction}_{arity}", arrays=arrays)
    for j in range(arity):
        moved = ("bucket[offset + i]", f"a{j}[i]")
        statement = " = ".join(moved if direction == "pack" else moved[::-1])
        source += _MOVE_STEP.format(j=j, length=arity + j, flat=2 * arity + j, statement=statement)
    namespace: dict[str, Any] = {"cuda": cuda}
    exec(compile(source, f"<ferrodist.gpu {direction} kernel, {arity} arrays>", "exec"), namespace)
    return cuda.jit(namespace[f"{direction}_{arity}"])


def pack(
    bucket: Any,
    srcs: Sequence[Any],
    offsets: Sequence[int] | None = None,
    *,
    stream: Any = None,
    threads: int = THREADS_PER_BLOCK,
    max_blocks: int = MAX_BLOCKS,
) -> None:
    """Copy every array of ``srcs`` into its slot of the flat ``bucket``, in one launch.

    Array ``j`` (flattened, C order) lands at ``bucket[offsets[j] : offsets[j] + srcs[j].size]``.
    The kernel takes the arrays as separate arguments plus a device table of int64 offsets
    and lengths; one kernel per arity (a power of two, up to :data:`MAX_ARRAYS_PER_LAUNCH`)
    is generated and cached, so more arrays than that take one launch per group.

    Args:
        bucket: flat device array receiving the elements.
        srcs: device arrays of the bucket's dtype (any shape, C-contiguous, zero-length allowed).
        offsets: each array's start in the bucket, in elements; default: back to back from 0.
            Slots must lie inside the bucket and must not overlap.
        stream: the CUDA stream to launch on (default: the default stream).
        threads: threads per block (see :func:`launch_config`).
        max_blocks: most blocks per launch.

    Raises:
        InvalidArgument: wrong arrays, mixed dtypes, or slots outside the bucket or overlapping.

    Example:
        >>> bucket = cuda.device_array(5, np.float32)
        >>> pack(bucket, [cuda.to_device(np.float32([1, 2])), cuda.to_device(np.float32([3, 4, 5]))])
        >>> bucket.copy_to_host()
        array([1., 2., 3., 4., 5.], dtype=float32)
    """
    _move("pack", bucket, srcs, offsets, stream, threads, max_blocks)


def unpack(
    bucket: Any,
    dsts: Sequence[Any],
    offsets: Sequence[int] | None = None,
    *,
    stream: Any = None,
    threads: int = THREADS_PER_BLOCK,
    max_blocks: int = MAX_BLOCKS,
) -> None:
    """Copy each slot of the flat ``bucket`` back into its array of ``dsts``, in one launch.

    The inverse of :func:`pack` with the same arrays and offsets (see there).

    Example:
        >>> a, b = cuda.device_array(2, np.float32), cuda.device_array(3, np.float32)
        >>> unpack(cuda.to_device(np.float32([1, 2, 3, 4, 5])), [a, b])
        >>> a.copy_to_host(), b.copy_to_host()
        (array([1., 2.], dtype=float32), array([3., 4., 5.], dtype=float32))
    """
    _move("unpack", bucket, dsts, offsets, stream, threads, max_blocks)


def _move(
    direction: str,
    bucket: Any,
    arrays: Sequence[Any],
    offsets: Sequence[int] | None,
    stream: Any,
    threads: int,
    max_blocks: int,
) -> None:
    operation = f"gpu {direction}"
    flat_bucket = _flat(bucket, "the bucket", operation)
    flats = [_flat(a, f"array {j}", operation) for j, a in enumerate(arrays)]
    for j, a in enumerate(flats):
        if a.dtype != flat_bucket.dtype:
            raise InvalidArgument(
                f"{operation}: array {j} has dtype {a.dtype} but the bucket has {flat_bucket.dtype}; "
                "a bucket holds one dtype (view same-sized types, or use one bucket per dtype)"
            )
    lengths = [int(a.size) for a in flats]
    starts = _slots(lengths, offsets, int(flat_bucket.size), operation)
    moved = [(a, s, n) for a, s, n in zip(flats, starts, lengths, strict=True) if n]  # empty arrays move nothing
    from numba import cuda

    for first in range(0, len(moved), MAX_ARRAYS_PER_LAUNCH):
        group = moved[first : first + MAX_ARRAYS_PER_LAUNCH]
        arity = 1 << (len(group) - 1).bit_length()  # pad to a power of two: few kernels to compile
        table = np.zeros(3 * arity, np.int64)  # rows: bucket start, length, flat start
        flat_start = 0
        for j, (_, start, n) in enumerate(group):
            table[j], table[arity + j], table[2 * arity + j] = start, n, flat_start
            flat_start += n
        padded = [a for a, _, _ in group] + [group[0][0]] * (arity - len(group))  # padding has length 0
        device_table = cuda.to_device(table, stream=0 if stream is None else stream)
        kernel = _move_kernel(direction, arity)
        launch(kernel, flat_start, stream, threads, max_blocks, flat_bucket, device_table, *padded)


def _slots(lengths: list[int], offsets: Sequence[int] | None, capacity: int, operation: str) -> list[int]:
    """Each array's start in the bucket, checked to lie inside it without overlapping."""
    if offsets is None:
        starts, total = [], 0
        for n in lengths:
            starts.append(total)
            total += n
        if total > capacity:
            raise InvalidArgument(
                f"{operation}: the arrays hold {total} elements but the bucket has room for {capacity}; "
                "allocate a bucket of at least the total size"
            )
        return starts
    try:
        starts = [operator.index(o) for o in offsets]
    except TypeError:
        raise InvalidArgument(f"{operation}: offsets must be integers (element counts), not {offsets!r}") from None
    if len(starts) != len(lengths):
        raise InvalidArgument(f"{operation}: {len(starts)} offsets for {len(lengths)} arrays; pass one per array")
    for j, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        if start < 0 or start + n > capacity:
            raise InvalidArgument(
                f"{operation}: array {j} ({n} elements at offset {start}) does not fit in the bucket of "
                f"{capacity} elements"
            )
    spans = sorted((start, start + n, j) for j, (start, n) in enumerate(zip(starts, lengths, strict=True)) if n)
    for (_, end, j), (start, _, k) in itertools.pairwise(spans):
        if start < end:
            raise InvalidArgument(
                f"{operation}: the slots of arrays {j} and {k} overlap in the bucket; fix the offsets"
            )
    return starts
