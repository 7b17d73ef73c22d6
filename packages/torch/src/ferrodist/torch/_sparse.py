"""``all_reduce`` of a sparse COO tensor with SUM, as Gloo does it.

Every rank's coalesced indices and values are gathered and added up: first a header per
rank (its count of non-zero entries, sparse and dense dimensions, shape and dtype), so
that ranks whose tensors do not match raise on every rank before anything else moves;
then the indices and the values, each rank's padded to the largest count. Every rank then
builds the same sparse tensor from every rank's entries, in rank order, coalesces it
(duplicate indices are summed) and copies it into its own tensor. The three steps are
three blocking calls on the group: a sparse all_reduce has finished when it returns, with
``async_op=True`` too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ferrodist.collectives import ProcessGroup
from ferrodist.core import InvalidArgument

from ._tensors import Staging, dense_only

#: Header columns: non-zero entries, sparse dims, dense dims, a code of the values' dtype, then the shape.
_NNZ, _SPARSE, _DENSE, _DTYPE, _SHAPE = 0, 1, 2, 3, 4
#: The most dimensions a header has room for.
_MAX_DIMS = 64
#: The dtypes whose tensors ferrodist moves, by their number in a header.
_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
)  # fmt: skip


def sparse_all_reduce(group: ProcessGroup, tensor: torch.Tensor, op: str, timeout: float | None) -> None:
    """Replace the sparse COO ``tensor`` with the sum of every rank's (``op`` must be SUM)."""
    rank = group.rank
    if tensor.layout != torch.sparse_coo:
        raise dense_only(tensor, rank, "allreduce", "tensor")
    if op != "SUM":
        raise InvalidArgument(
            f"rank {rank}: allreduce: a sparse COO tensor is reduced with SUM only (as Gloo does), not {op}; "
            "use .to_dense() for other ops",
            rank=rank,
            operation="allreduce",
        )
    if tensor.dim() > _MAX_DIMS:
        raise InvalidArgument(
            f"rank {rank}: allreduce: the sparse tensor has {tensor.dim()} dimensions; the ferrodist backend "
            f"reduces sparse tensors of at most {_MAX_DIMS}",
            rank=rank,
            operation="allreduce",
        )
    staging = Staging(rank, "allreduce")
    mine = tensor.detach().coalesce()
    indices, values = mine.indices(), mine.values().contiguous()
    dtype = str(values.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:  # refused before anything is sent
        raise InvalidArgument(
            f"rank {rank}: allreduce: torch.{dtype} sparse tensors are not supported by the ferrodist backend; "
            f"use one of {', '.join(_DTYPES)}",
            rank=rank,
            operation="allreduce",
        )
    header = np.full(_SHAPE + _MAX_DIMS, -1, np.int64)
    header[[_NNZ, _SPARSE, _DENSE, _DTYPE]] = (
        mine._nnz(),
        mine.sparse_dim(),
        mine.dense_dim(),
        _DTYPES.index(dtype),
    )
    header[_SHAPE : _SHAPE + tensor.dim()] = tuple(tensor.shape)
    headers = [np.empty_like(header) for _ in range(group.size)]
    group.all_gather(headers, header, timeout=timeout)
    _check_alike(headers, group)
    counts = [int(h[_NNZ]) for h in headers]
    widest = max(counts)
    sent_indices = _padded(indices, 1, widest)
    got_indices = [torch.empty_like(sent_indices) for _ in counts]
    group.all_gather(
        staging.args(got_indices, output=True, what="indices"), staging.view(sent_indices), timeout=timeout
    )
    sent_values = _padded(values, 0, widest)
    got_values = [torch.empty_like(sent_values) for _ in counts]
    group.all_gather(staging.args(got_values, output=True, what="values"), staging.view(sent_values), timeout=timeout)
    total = torch.sparse_coo_tensor(
        torch.cat([i[:, :n] for i, n in zip(got_indices, counts, strict=True)], dim=1),
        torch.cat([v[:n] for v, n in zip(got_values, counts, strict=True)]),
        tensor.shape,
        check_invariants=True,
    ).coalesce()
    with torch.no_grad():
        tensor.copy_(total)


def _padded(part: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """``part`` (contiguous) with zeros appended along ``dim`` up to ``width``."""
    shape = list(part.shape)
    shape[dim] = width
    out = torch.zeros(shape, dtype=part.dtype)
    out.narrow(dim, 0, part.shape[dim]).copy_(part)
    return out


def _check_alike(headers: list[Any], group: ProcessGroup) -> None:
    """Raise on every rank (each has every header) when the ranks' tensors differ in
    shape, sparse or dense dimensions, or dtype."""
    if all(np.array_equal(h[_SPARSE:], headers[0][_SPARSE:]) for h in headers):
        return
    described = "; ".join(f"rank {group.ranks[r]}: {_describe(h)}" for r, h in enumerate(headers))
    raise InvalidArgument(
        f"rank {group.global_rank}: allreduce: the ranks' sparse tensors differ ({described}); every rank "
        "passes a sparse COO tensor of one shape, dtype and number of sparse and dense dimensions. Nothing "
        "was changed",
        rank=group.global_rank,
        operation="allreduce",
    )


def _describe(header: Any) -> str:
    shape = tuple(int(x) for x in header[_SHAPE:] if x >= 0)
    return f"{_DTYPES[int(header[_DTYPE])]} {shape}, {int(header[_SPARSE])} sparse + {int(header[_DENSE])} dense dims"
