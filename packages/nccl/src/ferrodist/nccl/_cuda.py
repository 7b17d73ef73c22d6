"""The few CUDA runtime calls NCCL needs around it, through cuda-python, each error-checked.

cuda-python is imported inside the functions (never at import time). Handles (streams,
events, device pointers) are plain ``int``; ``0`` is the legacy default stream.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ferrodist.core import BackendUnavailable, DeviceUnavailable, FerrodistError, InvalidArgument
from ferrodist.core import cuda as core_cuda

__all__ = [
    "check_cuda",
    "create_event",
    "create_stream",
    "current_device",
    "destroy_event",
    "destroy_stream",
    "device_count",
    "free",
    "malloc",
    "memcpy_async",
    "memcpy_dtoh",
    "memcpy_htod",
    "pointer_device",
    "query_event",
    "query_stream",
    "record_event",
    "require_device",
    "runtime",
    "set_device",
    "stream_handle",
    "synchronize_stream",
]

#: What to do instead, when CUDA says there is no usable GPU.
_NO_GPU = (
    "NCCL needs one per rank (check that the driver is new enough for the CUDA runtime); use the CPU "
    "ProcessGroup from ferrodist.collectives"
)


def runtime() -> Any:
    """``cuda.bindings.runtime`` (cuda-python >= 12.6), or ``cuda.cudart`` from older releases."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        try:
            from cuda import cudart as rt  # type: ignore[attr-defined, no-redef]
        except ImportError:
            raise BackendUnavailable(
                "ferrodist.nccl needs cuda-python for streams and device memory: "
                "pip install -e './packages/nccl[cu12]' from a clone of ferrodist (or pip install cuda-python)"
            ) from None
    return rt


def check_cuda(result: Any, operation: str, *, rank: int | None = None) -> Any:
    """Unpack a cuda-python runtime result ``(error, *values)``: the value(s), or raise the
    ferrodist error that core's one map gives (``ferrodist.core.cuda.error``)."""
    return core_cuda.check(result, operation, rank=rank, runtime=runtime(), no_device=_NO_GPU)


def cuda_error(err: Any, operation: str, *, rank: int | None = None) -> FerrodistError:
    """The ferrodist error for a failed CUDA runtime call (core's one map)."""
    return core_cuda.error(err, operation, rank=rank, runtime=runtime(), no_device=_NO_GPU)


def device_count() -> int:
    """The number of CUDA GPUs this process sees.

    Raises:
        DeviceUnavailable: the driver is missing or too old, or CUDA cannot initialise.
        BackendUnavailable: cuda-python is not installed.
    """
    rt = runtime()
    err, count = rt.cudaGetDeviceCount()
    if int(err) == int(rt.cudaError_t.cudaErrorNoDevice):
        return 0
    check_cuda((err,), "cudaGetDeviceCount")
    return int(count)


def require_device(index: int | None, operation: str, *, rank: int | None = None) -> int:
    """The GPU to use: ``index``, else ``$LOCAL_RANK`` or ``rank`` modulo the GPU count.

    Raises:
        DeviceUnavailable: there is no GPU, or ``index`` is not one of them.
    """
    where = f"rank {rank}: " if rank is not None else ""
    try:
        count = device_count()
    except FerrodistError as exc:
        raise exc.with_context(f"{where}{operation}", rank=rank, operation=operation) from None
    if count == 0:
        raise DeviceUnavailable(
            f"{where}{operation}: no CUDA GPU is visible (cudaGetDeviceCount returned 0); NCCL needs one GPU per "
            "rank: check CUDA_VISIBLE_DEVICES, or use the CPU ProcessGroup from ferrodist.collectives",
            rank=rank,
            operation=operation,
        )
    if index is None:
        local = os.environ.get("LOCAL_RANK", "")
        base = int(local) if local.isdigit() else (rank or 0)
        return base % count
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise DeviceUnavailable(
            f"{where}{operation}: device {index!r} does not exist; this process sees {count} GPU(s): 0..{count - 1}",
            rank=rank,
            operation=operation,
        )
    return index


def current_device() -> int:
    return int(check_cuda(runtime().cudaGetDevice(), "cudaGetDevice"))


def set_device(index: int) -> None:
    check_cuda(runtime().cudaSetDevice(index), f"cudaSetDevice({index})")


def create_stream() -> int:
    """A new stream on the current device that also orders with the legacy default stream."""
    rt = runtime()
    stream = check_cuda(rt.cudaStreamCreateWithFlags(rt.cudaStreamDefault), "cudaStreamCreate")
    return int(stream)


def destroy_stream(stream: int) -> None:
    check_cuda(runtime().cudaStreamDestroy(stream), "cudaStreamDestroy")


def synchronize_stream(stream: int) -> None:
    """Block until ``stream`` is idle (no timeout: prefer polling :func:`query_stream`)."""
    check_cuda(runtime().cudaStreamSynchronize(stream), "cudaStreamSynchronize")


def _ready(result: Any, operation: str) -> bool:
    rt = runtime()
    err = result[0] if isinstance(result, tuple) else result
    if int(err) == int(rt.cudaError_t.cudaErrorNotReady):
        return False
    check_cuda((err,), operation)
    return True


def query_stream(stream: int) -> bool:
    """True once all work on ``stream`` has finished (never blocks)."""
    return _ready(runtime().cudaStreamQuery(stream), "cudaStreamQuery")


def create_event() -> int:
    rt = runtime()
    return int(check_cuda(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreate"))


def record_event(event: int, stream: int) -> None:
    check_cuda(runtime().cudaEventRecord(event, stream), "cudaEventRecord")


def query_event(event: int) -> bool:
    """True once the work recorded before ``event`` has finished (never blocks)."""
    return _ready(runtime().cudaEventQuery(event), "cudaEventQuery")


def destroy_event(event: int) -> None:
    check_cuda(runtime().cudaEventDestroy(event), "cudaEventDestroy")


def pointer_device(pointer: int) -> int | None:
    """The GPU whose memory ``pointer`` points into, or ``None`` for host memory."""
    rt = runtime()
    attributes = check_cuda(rt.cudaPointerGetAttributes(pointer), "cudaPointerGetAttributes")
    kind = attributes.type
    if kind in (rt.cudaMemoryType.cudaMemoryTypeDevice, rt.cudaMemoryType.cudaMemoryTypeManaged):
        return int(attributes.device)
    return None


def malloc(nbytes: int) -> int:
    """``cudaMalloc`` on the current device; release with :func:`free`."""
    return int(check_cuda(runtime().cudaMalloc(max(int(nbytes), 1)), f"cudaMalloc({nbytes})"))


def free(pointer: int) -> None:
    check_cuda(runtime().cudaFree(pointer), "cudaFree")


def memcpy_htod(pointer: int, array: np.ndarray[Any, Any]) -> None:
    """Copy a contiguous host array to device memory (synchronous)."""
    rt = runtime()
    host = np.ascontiguousarray(array)
    kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    check_cuda(rt.cudaMemcpy(pointer, host.ctypes.data, host.nbytes, kind), "cudaMemcpy(host to device)")


def memcpy_dtoh(array: np.ndarray[Any, Any], pointer: int) -> None:
    """Copy device memory into a C-contiguous host array (synchronous)."""
    if not array.flags.c_contiguous:
        raise InvalidArgument("memcpy_dtoh needs a C-contiguous destination array")
    rt = runtime()
    kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    check_cuda(rt.cudaMemcpy(array.ctypes.data, pointer, array.nbytes, kind), "cudaMemcpy(device to host)")


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Device-to-device copy enqueued on ``stream``."""
    rt = runtime()
    kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    check_cuda(rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")


def stream_handle(stream: object) -> int:
    """A raw ``cudaStream_t`` from an int, a cuda-python stream, or a CuPy / PyTorch / Numba stream."""
    if isinstance(stream, bool):
        raise InvalidArgument(f"stream must be a CUDA stream or its integer handle, not {stream!r}")
    if isinstance(stream, int):
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if callable(protocol):
        return int(protocol()[1])
    for attribute in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attribute, None)
        if value is not None:
            value = getattr(value, "value", value)  # numba's handle is a ctypes c_void_p
            return int(value or 0)
    try:
        return int(stream)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"cannot read a CUDA stream handle from a {type(stream).__name__}; pass an int or a "
            "cuda-python / CuPy / PyTorch / Numba stream"
        ) from None
