"""torch tensors in, what ferrodist's collectives take out, and results back.

A contiguous CPU tensor becomes a numpy array over the same memory (core's ``host_view``,
which also views bfloat16), so a collective writes straight into the tensor. A CUDA tensor is handed over as it is: ferrodist's
``as_tensor`` views it through ``__cuda_array_interface__`` and the group runs it on the
device engine of ferrodist-gpu. A tensor that is not contiguous goes through a contiguous
copy, which is copied back into it when the call has finished (``Staging.finish``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ferrodist.core import InvalidArgument, bfloat16, host_view

#: The reduce ops of torch (by ``RedOpType`` name) that ferrodist has under the same name.
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


class Staging:
    """The tensors of one call, as ferrodist takes them.

    Args:
        rank: this rank in the torch group, for messages.
        operation: torch's name of the call, for messages.
    """

    def __init__(self, rank: int, operation: str) -> None:
        self.rank = rank
        self.operation = operation
        self.cuda = False
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def contiguous(self, tensor: object, *, output: bool, what: str = "tensor") -> torch.Tensor:
        """``tensor`` itself when contiguous; else a contiguous copy, copied back into
        ``tensor`` by ``finish`` when ``output``."""
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgument(
                f"rank {self.rank}: {self.operation}: {what} must be a torch.Tensor, not {type(tensor).__name__}",
                rank=self.rank,
                operation=self.operation,
            )
        if tensor.layout != torch.strided:
            raise dense_only(tensor, self.rank, self.operation, what)
        if tensor.device.type not in ("cpu", "cuda"):
            raise InvalidArgument(
                f"rank {self.rank}: {self.operation}: {what} is on {tensor.device}; the ferrodist backend runs "
                "tensors on the CPU and on CUDA devices",
                rank=self.rank,
                operation=self.operation,
            )
        if tensor.device.type == "cuda" and not self.cuda:
            self.cuda = True
            torch.cuda.current_stream(tensor.device).synchronize()  # the producer's kernels are done
        if tensor.is_contiguous():
            return tensor
        staged = tensor.contiguous()
        if output:
            self._back.append((tensor, staged))
        return staged

    def view(self, tensor: torch.Tensor) -> Any:
        """What ferrodist is given for a contiguous tensor: a numpy array over the same
        memory on the CPU (core's ``host_view``, bfloat16 included), the tensor itself on CUDA."""
        if tensor.device.type == "cuda":
            return tensor
        array = host_view(tensor)
        if array is None:  # complex32, float8, quantized, ...: not a dtype ferrodist moves
            raise InvalidArgument(
                f"rank {self.rank}: {self.operation}: torch.{str(tensor.dtype).removeprefix('torch.')} tensors are "
                "not supported by the ferrodist backend; use a float, int, uint or bool dtype",
                rank=self.rank,
                operation=self.operation,
            )
        return array

    def arg(self, tensor: object, *, output: bool, what: str = "tensor") -> Any:
        """``view(contiguous(tensor))``."""
        return self.view(self.contiguous(tensor, output=output, what=what))

    def args(self, tensors: Sequence[object], *, output: bool, what: str) -> list[Any]:
        return [self.arg(t, output=output, what=f"{what}[{i}]") for i, t in enumerate(tensors)]

    def rows(self, tensor: torch.Tensor, sizes: Sequence[int], parts: int, *, what: str) -> Any:
        """``tensor`` (contiguous) cut along dim 0 into blocks of ``sizes`` rows, as a list of
        views as ferrodist takes them; without ``sizes``, the one view (ferrodist cuts it into
        ``parts`` equal blocks)."""
        if not sizes:
            return self.view(tensor)
        if len(sizes) != parts or any(int(s) < 0 for s in sizes):
            raise InvalidArgument(
                f"rank {self.rank}: {self.operation}: {what} split sizes {list(sizes)} must be {parts} "
                "non-negative row counts, one per rank of the group",
                rank=self.rank,
                operation=self.operation,
            )
        rows = tensor.shape[0] if tensor.dim() else 1
        if sum(int(s) for s in sizes) != rows:
            raise InvalidArgument(
                f"rank {self.rank}: {self.operation}: {what} split sizes {list(sizes)} add up to "
                f"{sum(int(s) for s in sizes)} rows, but the tensor has {rows} (shape {tuple(tensor.shape)})",
                rank=self.rank,
                operation=self.operation,
            )
        return [self.view(piece) for piece in torch.split(tensor, [int(s) for s in sizes])]

    def finish(self) -> None:
        """After the call: copy staged results back."""
        for tensor, staged in self._back:
            tensor.copy_(staged)
        # CUDA: nothing to wait for here. The engine waited for its own copies and kernels
        # before the call returned, and the copies back above run on the current stream,
        # in order before whatever the caller runs on it next.


def dense_only(tensor: torch.Tensor, rank: int, operation: str, what: str) -> InvalidArgument:
    """The error for a tensor that is not strided (dense) where only dense tensors go."""
    hint = (
        "all_reduce with SUM takes sparse COO tensors; elsewhere use .to_dense()"
        if tensor.layout == torch.sparse_coo
        else "convert it with .to_dense() (or .to_sparse_coo() for all_reduce with SUM)"
    )
    return InvalidArgument(
        f"rank {rank}: {operation}: {what} has layout {tensor.layout}; the ferrodist backend moves strided "
        f"(dense) tensors: {hint}",
        rank=rank,
        operation=operation,
    )


def single(tensors: Sequence[Any], rank: int, operation: str, what: str = "tensors") -> Any:
    """The one tensor of a list that torch passes for one tensor per process."""
    if len(tensors) != 1:
        raise InvalidArgument(
            f"rank {rank}: {operation}: the ferrodist backend takes one tensor per process, got {len(tensors)} "
            f"in {what} (torch's multi-device lists are not supported)",
            rank=rank,
            operation=operation,
        )
    return tensors[0]


def as_numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype ferrodist sees for a torch dtype (for tests and messages)."""
    if dtype == torch.bfloat16:
        return bfloat16.numpy
    return np.dtype(torch.empty(0, dtype=dtype).numpy().dtype)
