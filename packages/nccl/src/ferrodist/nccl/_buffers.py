"""Device buffers, dtypes and reduce ops as NCCL sees them: a pointer, a count, an enum."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ferrodist.core import (
    DeviceUnavailable,
    DType,
    InvalidArgument,
    ReduceOp,
    as_tensor,
    check_op,
    dtype,
)

from ._library import RedOp

__all__ = ["DeviceBuffer", "blocks", "device_buffer", "nccl_datatype", "nccl_op"]

_OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: RedOp.ncclSum,
    ReduceOp.PRODUCT: RedOp.ncclProd,
    ReduceOp.MIN: RedOp.ncclMin,
    ReduceOp.MAX: RedOp.ncclMax,
    ReduceOp.AVG: RedOp.ncclAvg,
}
# bool travels as uint8 0/1: a logical or is a max, a logical and a min (as in numpy).
_BOOL_OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: RedOp.ncclMax,
    ReduceOp.MAX: RedOp.ncclMax,
    ReduceOp.PRODUCT: RedOp.ncclMin,
    ReduceOp.MIN: RedOp.ncclMin,
}


@dataclass(frozen=True)
class DeviceBuffer:
    """``count`` elements of ``dtype`` at device address ``ptr``, on GPU ``device`` when that
    is known (a buffer made from a ``Tensor`` knows it; one made from a bare pointer does
    not, and the communicator asks CUDA once per use)."""

    ptr: int
    count: int
    dtype: DType
    device: int | None = None

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def block(self, index: int, count: int) -> DeviceBuffer:
        """Elements ``index * count .. (index + 1) * count`` as a buffer of their own."""
        return DeviceBuffer(self.ptr + index * count * self.dtype.itemsize, count, self.dtype, self.device)


def _where(rank: int | None, operation: str) -> str:
    return f"rank {rank}: {operation}" if rank is not None else operation


def _device_pointer(x: object) -> int:
    """The device address of a CUDA array: ``x.data_ptr()`` (a core ``Tensor``, a torch
    tensor) if it has one, else its ``__cuda_array_interface__['data'][0]``."""
    data_ptr = getattr(x, "data_ptr", None)
    if callable(data_ptr):
        return int(data_ptr())
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is not None:
        return int(interface["data"][0] or 0)
    raise InvalidArgument(f"cannot find the device address of a {type(x).__name__}")


def _from_interface(x: object, interface: dict[str, Any], where: str, name: str) -> DeviceBuffer:
    shape = tuple(int(n) for n in interface["shape"])
    try:
        dt = dtype(np.dtype(interface["typestr"]))
    except TypeError:
        raise InvalidArgument(f"{where}: {name} has the unknown element type {interface['typestr']!r}") from None
    strides = interface.get("strides")
    if strides is not None:
        expected, step = [], dt.itemsize
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        if any(n > 1 and s != e for n, s, e in zip(shape, strides, reversed(expected), strict=True)):
            raise InvalidArgument(
                f"{where}: {name} of shape {shape} with strides {tuple(strides)} is not C-contiguous; NCCL "
                "works in place and ferrodist will not copy silently: pass a contiguous array (x.copy() / "
                "x.contiguous()) and read the result from that"
            )
    count = int(np.prod(shape, dtype=np.int64))
    return DeviceBuffer(_device_pointer(x), count, dt)


def device_buffer(x: object, *, name: str, operation: str, rank: int | None = None) -> DeviceBuffer:
    """View a CUDA array (anything ``as_tensor`` accepts, or any ``__cuda_array_interface__``
    exporter) as a :class:`DeviceBuffer`, without copying.

    Raises:
        InvalidArgument: ``x`` is on the CPU, is not contiguous, or has an unsupported dtype.
    """
    if isinstance(x, DeviceBuffer):
        return x
    where = _where(rank, operation)
    try:
        tensor = as_tensor(x)
    except DeviceUnavailable as unavailable:
        try:
            interface = x.__cuda_array_interface__  # type: ignore[attr-defined]
        except AttributeError:
            raise unavailable from None
        except (TypeError, ValueError) as exc:  # e.g. a torch bfloat16 CUDA tensor
            raise InvalidArgument(
                f"{where}: {name}: cannot read its __cuda_array_interface__ ({exc})", rank=rank, operation=operation
            ) from exc
        buffer = _from_interface(x, interface, where, name)
    except InvalidArgument as exc:
        raise exc.with_context(f"{where}: {name}", rank=rank, operation=operation) from None
    else:
        if tensor.device.type != "cuda":
            raise InvalidArgument(
                f"{where}: {name} is a {tensor.device} tensor, but NCCL reads and writes GPU memory only; pass a "
                "CUDA array (Numba, CuPy, PyTorch on cuda), or use the CPU ProcessGroup of ferrodist.collectives",
                rank=rank,
                operation=operation,
            )
        buffer = DeviceBuffer(_device_pointer(tensor), tensor.numel, tensor.dtype, tensor.device.index)
    if buffer.ptr == 0 and buffer.count > 0:
        raise InvalidArgument(f"{where}: {name} has a NULL device pointer", rank=rank, operation=operation)
    return buffer


def blocks(
    x: object, count: int, size: int, *, name: str, operation: str, rank: int | None = None
) -> list[DeviceBuffer]:
    """``size`` buffers of ``count`` elements each: from a list/tuple of ``size`` arrays, or
    one array of ``size * count`` elements cut rank-major."""
    where = _where(rank, operation)
    if isinstance(x, (list, tuple)):
        if len(x) != size:
            raise InvalidArgument(
                f"{where}: {name} has {len(x)} entries; the group has {size} ranks, pass one per rank",
                rank=rank,
                operation=operation,
            )
        parts = [device_buffer(p, name=f"{name}[{i}]", operation=operation, rank=rank) for i, p in enumerate(x)]
        for i, part in enumerate(parts):
            if part.count != count:
                raise InvalidArgument(
                    f"{where}: {name}[{i}] has {part.count} elements, expected {count}", rank=rank, operation=operation
                )
        return parts
    whole = device_buffer(x, name=name, operation=operation, rank=rank)
    if whole.count != size * count:
        raise InvalidArgument(
            f"{where}: {name} has {whole.count} elements; expected {size} x {count} = {size * count} "
            "(one block per rank), or pass a list of per-rank arrays",
            rank=rank,
            operation=operation,
        )
    return [whole.block(i, count) for i in range(size)]


def nccl_datatype(dt: DType, *, operation: str, rank: int | None = None) -> int:
    """The ``ncclDataType_t`` for ``dt``; ``InvalidArgument`` where NCCL has no such type."""
    if dt.nccl is None:
        raise InvalidArgument(
            f"{_where(rank, operation)}: NCCL has no {dt.name} type; convert to int32 (or float32) first, or, for "
            "broadcast/all_gather/send/recv that only move bytes, view the array as float16 or uint8",
            rank=rank,
            operation=operation,
        )
    return dt.nccl


def nccl_op(op: ReduceOp | str, dt: DType, *, operation: str, rank: int | None = None) -> int:
    """The ``ncclRedOp_t`` for ``op`` on ``dt``; ``InvalidArgument`` for bitwise ops and for
    ops the dtype does not support (AVG on integers)."""
    reduce_op = ReduceOp.coerce(op)
    check_op(reduce_op, dt, operation=operation, rank=rank)
    table = _BOOL_OPS if dt.kind == "bool" else _OPS
    if reduce_op not in table:
        raise InvalidArgument(
            f"{_where(rank, operation)}: NCCL has no {reduce_op.name} reduction for {dt.name}; NCCL reduces with "
            "SUM, PRODUCT, MIN, MAX and AVG only: use the CPU ProcessGroup for bitwise reductions",
            rank=rank,
            operation=operation,
        )
    return int(table[reduce_op])
