"""Activations and gradients between stages: tags, the step header, reusable buffers.

Every stage boundary ``b`` (stage b to stage b + 1) carries, per micro-batch, one
activation forward and one gradient backward, each on a tag of its own, so receives match
by identity and not by order. Before its first activation of a step, a boundary carries a
header: the step's number and mode, the batch size, and the activation's dtype and shape
past the batch dimension. The receiver checks it against what its stage takes and sizes
every receive buffer of the step from it, on its own stage's device; the sender checks
that every later activation keeps to it. Activations and gradients may be any array that
``as_tensor`` accepts, on the host or a GPU; the header itself is host memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferrodist.core import ALL_DTYPES, CollectiveMismatch, DType, InvalidArgument, Tensor

__all__ = ["HEADER_WORDS", "Pool", "header", "read_header", "split_rows", "tag"]

MAGIC = 0x5049_5045_4C4E  # "PIPELN"
HEADER_WORDS = 16
MAX_DIMS = HEADER_WORDS - 6
_MB_BITS = 16
#: dtypes an activation may have; the header carries the index
DTYPES: tuple[DType, ...] = ALL_DTYPES


def tag(boundary: int, backward: bool, microbatch: int) -> int:
    """The point-to-point tag of one message (the header is micro-batch -1)."""
    return ((boundary * 2 + int(backward)) << _MB_BITS) + microbatch + 1


def check_sizes(n_stages: int, n_microbatches: int) -> None:
    if n_microbatches >= (1 << _MB_BITS) - 1:
        raise InvalidArgument(f"Pipeline: at most {(1 << _MB_BITS) - 2} micro-batches, not {n_microbatches}")
    if 2 * n_stages << _MB_BITS >= 1 << 31:
        raise InvalidArgument(f"Pipeline: too many stages ({n_stages}) for the message tags")


def split_rows(batch: int, n_microbatches: int, who: str) -> list[tuple[int, int]]:
    """Row ranges of the micro-batches: sizes differ by at most one, larger first."""
    if batch < n_microbatches:
        raise InvalidArgument(
            f"{who}: a batch of {batch} rows cannot make {n_microbatches} micro-batches; pass at least "
            f"{n_microbatches} rows or use fewer micro-batches"
        )
    base, extra = divmod(batch, n_microbatches)
    bounds, start = [], 0
    for i in range(n_microbatches):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def header(step: int, training: bool, batch: int, activation: Tensor, who: str) -> np.ndarray[Any, Any]:
    trailing = activation.shape[1:]
    if activation.ndim == 0 or len(trailing) > MAX_DIMS:
        raise InvalidArgument(
            f"{who}: an activation must have a batch dimension and at most {MAX_DIMS} more, not shape "
            f"{activation.shape}"
        )
    words = np.zeros(HEADER_WORDS, np.int64)
    words[:6] = (MAGIC, step, int(training), batch, DTYPES.index(activation.dtype), len(trailing))
    words[6 : 6 + len(trailing)] = trailing
    return words


def read_header(words: np.ndarray[Any, Any], step: int, training: bool, who: str) -> tuple[int, DType, tuple[int, ...]]:
    """(batch, dtype, trailing shape) from a received header, checked against this rank's step."""
    if int(words[0]) != MAGIC:
        raise CollectiveMismatch(f"{who}: the previous stage sent something that is not a pipeline step header")
    if int(words[1]) != step or bool(words[2]) != training:
        raise CollectiveMismatch(
            f"{who}: the previous stage is in {'train' if words[2] else 'eval'}_step #{int(words[1])}, this rank in "
            f"{'train' if training else 'eval'}_step #{step}: every stage must make the same calls"
        )
    ndim = int(words[5])
    return int(words[3]), DTYPES[int(words[4])], tuple(int(d) for d in words[6 : 6 + ndim])


class Pool:
    """Receive buffers by (chunk, shape, dtype), handed out and taken back across micro-batches."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, tuple[int, ...], str], list[Any]] = {}

    def take(self, chunk: int, shape: tuple[int, ...], dtype: DType, make: Any) -> Any:
        """A free buffer of chunk ``chunk``, or ``make(shape, dtype)``."""
        free = self._free.get((chunk, shape, dtype.name))
        return free.pop() if free else make(shape, dtype)

    def give(self, chunk: int, buffer: Any, dtype: DType) -> None:
        self._free.setdefault((chunk, tuple(buffer.shape), dtype.name), []).append(buffer)
