"""``Tensor``: a zero-copy view over one contiguous buffer, and ``as_tensor``, the one
place where foreign array objects (numpy, Python buffers, DLPack, PyTorch) are inspected."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._device import CPU, Device, device
from ._dtypes import DType, dtype
from ._errors import DeviceUnavailable, InvalidArgument

__all__ = ["Tensor", "as_tensor"]


class Tensor:
    """A contiguous n-dimensional buffer that ferrodist reads and writes in place.

    A ``Tensor`` never owns a copy of the user's data: on ``cpu`` it wraps a numpy
    array that shares memory with whatever ``as_tensor`` was given, so an in-place
    collective on the tensor is visible in the original object.

    Build one with :func:`as_tensor`; ``Tensor(array)`` accepts a C-contiguous numpy array.

    Example:
        >>> a = np.arange(4, dtype=np.float32)
        >>> t = as_tensor(a)
        >>> t.shape, t.dtype.name, str(t.device)
        ((4,), 'float32', 'cpu')
    """

    __slots__ = ("_array", "_device", "_dtype", "_source")

    def __init__(self, array: np.ndarray[Any, Any], *, source: object = None) -> None:
        if not isinstance(array, np.ndarray):
            raise InvalidArgument(f"Tensor(...) takes a numpy array, not {type(array).__name__}; use as_tensor()")
        self._dtype: DType = dtype(array.dtype)
        if not array.flags.c_contiguous:
            raise InvalidArgument(_non_contiguous_message(array.shape, array.strides))
        self._array = array
        self._device: Device = CPU
        self._source = source  # keeps a DLPack producer alive as long as this view

    # -- description -------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def ndim(self) -> int:
        return int(self._array.ndim)

    @property
    def numel(self) -> int:
        return int(self._array.size)

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def device(self) -> Device:
        return self._device

    @property
    def nbytes(self) -> int:
        return int(self._array.nbytes)

    @property
    def writeable(self) -> bool:
        return bool(self._array.flags.writeable)

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self._dtype.name}, device={self._device})"

    # -- data ----------------------------------------------------------------------------
    def numpy(self) -> np.ndarray[Any, Any]:
        """The numpy array sharing this tensor's memory (no copy)."""
        return self._array

    def flat(self) -> np.ndarray[Any, Any]:
        """A one-dimensional view of the elements (no copy)."""
        return self._array.reshape(-1)

    def bytes_view(self) -> np.ndarray[Any, Any]:
        """A one-dimensional uint8 view of the bytes (no copy)."""
        return self._array.reshape(-1).view(np.uint8)

    def to(self, target: str | Device) -> Tensor:
        """This tensor on ``target``: itself if already there, else a copy there."""
        dev = device(target)
        if dev.type == "cpu":
            return self
        raise DeviceUnavailable(
            f"Tensor.to({str(dev)!r}): CUDA tensors need the ferrodist-gpu package "
            "(pip install ferrodist-gpu) and a CUDA device or NUMBA_ENABLE_CUDASIM=1"
        )

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        if dtype is not None and np.dtype(dtype) != self._array.dtype:
            return self._array.astype(dtype)
        return self._array

    def __dlpack__(self, **kwargs: Any) -> Any:
        try:
            return self._array.__dlpack__(**kwargs)
        except (BufferError, TypeError) as exc:
            raise InvalidArgument(
                f"a {self._dtype.name} tensor cannot be exported through DLPack by numpy ({exc}); "
                "export tensor.numpy().view(np.uint16) and reinterpret it on the other side"
            ) from exc

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


def _non_contiguous_message(shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    return (
        f"tensor of shape {tuple(shape)} with strides {tuple(strides)} is not C-contiguous; "
        "ferrodist works in place and will not silently copy (the result would be lost): "
        "pass np.ascontiguousarray(x) (or x.contiguous() in PyTorch) and read the result from that"
    )


def as_tensor(obj: object) -> Tensor:
    """View ``obj`` as a :class:`Tensor` without copying.

    Accepts a ``Tensor``, a numpy array, any object with the Python buffer protocol
    (``bytearray``, ``array.array``, ``memoryview``), a PyTorch CPU tensor (any dtype,
    bfloat16 included), or any object that exports DLPack on the CPU. A collective
    that writes into the tensor writes into ``obj``'s memory.

    Raises:
        InvalidArgument: the object is not an array, its dtype is not supported, or it
            is not contiguous (a copy would lose the in-place result).
        DeviceUnavailable: the object lives on a GPU (needs ferrodist-gpu).
    """
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, np.ndarray):
        return Tensor(obj)
    module = type(obj).__module__.partition(".")[0]
    if module == "torch":
        return _from_torch(obj)
    if hasattr(obj, "__cuda_array_interface__"):
        raise _gpu_unavailable(obj)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj)
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(
            f"as_tensor cannot view a {type(obj).__name__} in place; pass a numpy array, a buffer, "
            "a PyTorch tensor or a DLPack array (for a list, use np.asarray(x) and read the result from it)"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument(_non_contiguous_message(view.shape or (), view.strides or ()))
    return Tensor(np.asarray(view), source=obj)


def _gpu_unavailable(obj: object) -> DeviceUnavailable:
    return DeviceUnavailable(
        f"as_tensor got a GPU array ({type(obj).__name__}); GPU tensors need the ferrodist-gpu "
        "package (pip install ferrodist-gpu) and a CUDA device; move it to the CPU meanwhile"
    )


def _from_dlpack(obj: Any) -> Tensor:
    device_type, _ = obj.__dlpack_device__()
    if device_type != 1:  # kDLCPU
        raise _gpu_unavailable(obj)
    try:
        array = np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError) as exc:
        raise InvalidArgument(f"as_tensor: numpy could not import {type(obj).__name__} through DLPack: {exc}") from exc
    return Tensor(array, source=obj)


def _from_torch(obj: Any) -> Tensor:
    torch = sys.modules["torch"]
    if obj.device.type != "cpu":
        raise _gpu_unavailable(obj)
    if not obj.is_contiguous():
        raise InvalidArgument(_non_contiguous_message(tuple(obj.shape), tuple(obj.stride())))
    tensor = obj.detach()
    if tensor.dtype == torch.bfloat16:
        # numpy's DLPack import has no bfloat16: move the bits as int16, then reinterpret.
        array = np.from_dlpack(tensor.view(torch.int16)).view(dtype("bfloat16").numpy)
    else:
        try:
            array = np.from_dlpack(tensor)
        except (BufferError, TypeError, RuntimeError) as exc:
            raise InvalidArgument(f"as_tensor: a torch {tensor.dtype} tensor is not supported ({exc})") from exc
    return Tensor(array, source=obj)
