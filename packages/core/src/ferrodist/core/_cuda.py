"""The one door to ``numba.cuda`` for core: device arrays in and out, imported lazily.

Core never imports ``numba.cuda`` at import time. Everything here works the same on a
real GPU and under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), where "device
memory" is host memory and device arrays are ``FakeCUDAArray`` wrappers of numpy arrays.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from ._errors import DeviceUnavailable, InvalidArgument

__all__ = ["array_from_interface", "cuda", "device_index", "device_pointer", "is_device_array", "simulated"]

_HOW = (
    "install the NVIDIA driver and numba-cuda (pip install ferrodist-gpu) on a machine with a CUDA GPU, "
    "or set NUMBA_ENABLE_CUDASIM=1 before the first import of numba.cuda to use Numba's CUDA simulator"
)


@functools.cache
def _load() -> Any:
    try:
        from numba import cuda as module
    except ImportError as exc:  # pragma: no cover - numba ships numba.cuda, numba-cuda replaces it
        raise DeviceUnavailable(f"numba.cuda cannot be imported ({exc}); {_HOW}") from None
    return module


def cuda(operation: str = "a CUDA tensor") -> Any:
    """``numba.cuda``, or ``DeviceUnavailable`` saying what to install when there is no device."""
    module = _load()
    if not module.is_available():
        raise DeviceUnavailable(f"{operation} needs a CUDA device, and none is usable here; {_HOW}")
    return module


def simulated() -> bool:
    """True when Numba's CUDA simulator stands in for the GPU."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)  # type: ignore[attr-defined]


def is_device_array(obj: object) -> bool:
    """True for a Numba device array (or the simulator's stand-in), without importing numba.cuda."""
    module = type(obj).__module__
    return module.startswith(("numba.cuda.", "numba_cuda.")) and hasattr(obj, "copy_to_host")


def device_index() -> int:
    """The current CUDA device's ordinal (0 under the simulator)."""
    module = cuda()
    if simulated():
        return 0
    return int(module.get_current_device().id)


def device_pointer(array: Any) -> int:
    """The address of a device array's first byte (a host address under the simulator)."""
    if simulated():
        return int(array._ary.ctypes.data)
    return int(array.__cuda_array_interface__["data"][0])


def array_from_interface(obj: Any, interface: dict[str, Any]) -> Any:
    """A device array over the memory that ``interface`` (a ``__cuda_array_interface__``
    dict) describes, without copying; ``obj`` is kept alive by the result."""
    module = cuda("as_tensor of a CUDA array")
    shape = tuple(int(n) for n in interface["shape"])
    dt = np.dtype(interface["typestr"])
    if interface.get("mask") is not None:
        raise InvalidArgument("as_tensor: masked CUDA arrays are not supported; fill the masked values first")
    strides = interface.get("strides")
    if strides is not None and not _is_contiguous(shape, tuple(strides), dt.itemsize):
        raise InvalidArgument(
            f"as_tensor: the CUDA array of shape {shape} with strides {tuple(strides)} is not C-contiguous; "
            "ferrodist works in place and will not copy: pass a contiguous array (x.contiguous() / cupy.ascontiguousarray)"
        )
    pointer = int(interface["data"][0])
    if pointer == 0 and 0 not in shape:
        raise InvalidArgument(f"as_tensor: the CUDA array of shape {shape} has a null data pointer")
    if not simulated():
        return module.as_cuda_array(obj)
    # Simulator: the "device" pointer is a host address; view it and wrap it like to_device does.
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        host = np.empty(shape, dt)
    else:
        raw = (ctypes.c_byte * (count * dt.itemsize)).from_address(pointer)
        host = np.frombuffer(raw, dtype=dt).reshape(shape)
    array = FakeCUDAArray(host)
    array._ferrodist_owner = obj  # type: ignore[attr-defined]  # the producer's memory lives as long as this view
    return array


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """C-contiguity as numpy judges it: strides of dimensions of length 1 do not matter."""
    if 0 in shape:
        return True
    step = itemsize
    for n, stride in zip(reversed(shape), reversed(strides), strict=True):
        if n != 1 and stride != step:
            return False
        step *= n
    return True
