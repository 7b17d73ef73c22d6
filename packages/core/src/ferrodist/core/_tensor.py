"""``Tensor``: a zero-copy view over one contiguous buffer, and ``as_tensor``, the one
place where foreign array objects (numpy, Python buffers, DLPack, PyTorch, CUDA arrays)
are inspected."""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

import numpy as np

from . import _cuda, _dlpack
from ._device import CPU, Device, device
from ._dtypes import DType, bfloat16, dtype
from ._errors import InvalidArgument

__all__ = ["Tensor", "as_tensor", "device_view", "host_view", "is_torch_module"]


class Tensor:
    """A contiguous n-dimensional buffer that ferrodist reads and writes in place.

    A ``Tensor`` never owns a copy of the user's data: on ``cpu`` it wraps a numpy
    array, on ``cuda:k`` a Numba device array, that shares memory with whatever
    ``as_tensor`` was given, so an in-place collective on the tensor is visible in the
    original object. A bfloat16 device array holds the bits as uint16 (Numba has no
    bfloat16); the tensor's ``dtype`` says what they mean.

    Build one with :func:`as_tensor`; ``Tensor(array)`` accepts a C-contiguous numpy array,
    ``Tensor.from_device_array(array)`` a Numba device array.

    Example:
        >>> a = np.arange(4, dtype=np.float32)
        >>> t = as_tensor(a)
        >>> t.shape, t.dtype.name, str(t.device)
        ((4,), 'float32', 'cpu')
    """

    __slots__ = ("_array", "_device", "_dtype", "_pointer", "_shape", "_source")

    def __init__(self, array: np.ndarray[Any, Any], *, source: object = None) -> None:
        if not isinstance(array, np.ndarray):
            raise InvalidArgument(f"Tensor(...) takes a numpy array, not {type(array).__name__}; use as_tensor()")
        self._dtype: DType = dtype(array.dtype)
        if not array.flags.c_contiguous:
            raise InvalidArgument(_non_contiguous_message(array.shape, array.strides))
        self._array: Any = array  # a numpy array, or a Numba device array on CUDA (None until needed: _lazy)
        self._shape: tuple[int, ...] = array.shape
        self._pointer: int | None = None  # a CUDA tensor's address when known without its array
        self._device: Device = CPU
        self._source = source  # keeps a DLPack producer alive as long as this view

    @classmethod
    def from_device_array(cls, array: Any, *, dtype: DType | str | None = None, source: object = None) -> Tensor:
        """Wrap a C-contiguous Numba device array (no copy). ``dtype="bfloat16"`` reads a
        uint16 array as bfloat16 bits; otherwise the array's own dtype is used."""
        if not _cuda.is_device_array(array):
            raise InvalidArgument(f"Tensor.from_device_array takes a Numba device array, not {type(array).__name__}")
        if not array.is_c_contiguous():
            raise InvalidArgument(_non_contiguous_message(array.shape, array.strides))
        dt = _dtype_of_device(array.dtype, dtype)
        tensor = cls.__new__(cls)
        tensor._array = array
        tensor._shape = tuple(array.shape)
        tensor._pointer = None
        tensor._dtype = dt
        tensor._device = Device("cuda", _cuda.device_of(array))
        tensor._source = source
        return tensor

    @classmethod
    def _lazy(cls, source: Any, dt: DType, index: int, shape: tuple[int, ...], pointer: int) -> Tensor:
        """A CUDA tensor over a contiguous PyTorch CUDA tensor whose Numba device array is
        made only when something asks for it (the staged route needs the address only)."""
        tensor = cls.__new__(cls)
        tensor._array = None
        tensor._shape = shape
        tensor._pointer = pointer
        tensor._dtype = dt
        tensor._device = _cuda_device(index)
        tensor._source = source
        return tensor

    def _storage(self) -> Any:
        """The numpy or Numba array (made now for a lazy CUDA tensor)."""
        array = self._array
        if array is None:
            array = self._array = _from_torch(self._source)._array
        return array

    # -- description -------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def numel(self) -> int:
        return math.prod(self._shape)  # np.prod costs ~10 us a call: on every collective's path

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def device(self) -> Device:
        return self._device

    @property
    def nbytes(self) -> int:
        return self.numel * self._dtype.itemsize

    @property
    def is_cuda(self) -> bool:
        return self._device.type == "cuda"

    @property
    def writeable(self) -> bool:
        return self.is_cuda or bool(self._array.flags.writeable)

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self._dtype.name}, device={self._device})"

    # -- data ----------------------------------------------------------------------------
    def numpy(self) -> np.ndarray[Any, Any]:
        """The numpy array sharing this tensor's memory (no copy); CPU tensors only."""
        if self.is_cuda:
            raise InvalidArgument(
                f"Tensor.numpy(): this tensor is on {self._device}; copy it to the host with .to('cpu') first"
            )
        return self._array

    def device_array(self) -> Any:
        """The Numba device array sharing this tensor's memory (no copy); CUDA tensors only.
        A bfloat16 tensor's device array is uint16."""
        if not self.is_cuda:
            raise InvalidArgument("Tensor.device_array(): this tensor is on the CPU; use .numpy() or .to('cuda')")
        return self._storage()

    def flat(self) -> Any:
        """A one-dimensional view of the elements (no copy): a numpy array on the CPU, a
        Numba device array on CUDA (uint16 for bfloat16)."""
        return self._storage().reshape(-1)

    def bytes_view(self) -> Any:
        """A one-dimensional uint8 view of the bytes (no copy)."""
        return self._storage().reshape(-1).view(np.uint8)

    def data_ptr(self) -> int:
        """The address of the first byte: a host address on the CPU, a device pointer on CUDA."""
        if self.is_cuda:
            if self._pointer is None:
                self._pointer = _cuda.device_pointer(self._array)
            return self._pointer
        return int(self._array.ctypes.data)

    def to(self, target: str | Device) -> Tensor:
        """This tensor on ``target``: itself if already there, else a copy there.

        Example:
            >>> t = as_tensor(np.ones(3, np.float32))
            >>> t.to("cpu") is t
            True
        """
        dev = device(target)
        if dev.type == "cpu":
            if not self.is_cuda:
                return self
            _cuda.cuda(f"Tensor.to({str(dev)!r})")
            with _cuda.on_device(self._device.index):
                host = self._storage().copy_to_host()
            return Tensor(host.view(self._dtype.numpy))
        if self.is_cuda and dev.index in (None, self._device.index):
            return self
        module = _cuda.cuda(f"Tensor.to({str(dev)!r})")
        if dev.index not in (None, 0) and _cuda.simulated():
            raise InvalidArgument(f"Tensor.to({str(dev)!r}): the CUDA simulator has only device 0")
        with _cuda.on_device(dev.index):
            return self._to_current_device(module)

    def _to_current_device(self, module: Any) -> Tensor:
        host = self.numpy() if not self.is_cuda else self._storage().copy_to_host()
        storage = host.view(np.uint16) if self._dtype is bfloat16 else host
        return Tensor.from_device_array(module.to_device(np.ascontiguousarray(storage)), dtype=self._dtype)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if not self.is_cuda or _cuda.simulated():
            raise AttributeError("only CUDA tensors on a real device export __cuda_array_interface__")
        return dict(self._storage().__cuda_array_interface__)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        if self.is_cuda:
            raise TypeError(f"a tensor on {self._device} cannot become a numpy array implicitly; use .to('cpu')")
        if dtype is not None and np.dtype(dtype) != self._array.dtype:
            return self._array.astype(dtype)
        return self._array

    def __dlpack__(self, **kwargs: Any) -> Any:
        if self.is_cuda:
            raise InvalidArgument(
                "a CUDA tensor cannot be exported through DLPack by ferrodist; pass .device_array() "
                "(it has __cuda_array_interface__) to CuPy or PyTorch instead"
            )
        try:
            return self._array.__dlpack__(**kwargs)
        except (BufferError, TypeError) as exc:
            raise InvalidArgument(
                f"a {self._dtype.name} tensor cannot be exported through DLPack by numpy ({exc}); "
                "export tensor.numpy().view(np.uint16) and reinterpret it on the other side"
            ) from exc

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.is_cuda:
            return (2, self._device.index or 0)  # kDLCUDA
        return (1, 0)  # kDLCPU


def _dtype_of_device(storage: np.dtype[Any], requested: DType | str | None) -> DType:
    if requested is None:
        return dtype(storage)
    dt = dtype(requested)
    if dt is bfloat16 and storage in (np.dtype(np.uint16), np.dtype(np.int16)):
        return dt
    if dt.numpy != storage:
        raise InvalidArgument(
            f"a {storage} device array cannot be read as {dt.name}; pass dtype=None or a matching dtype"
        )
    return dt


def _non_contiguous_message(shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    return (
        f"tensor of shape {tuple(shape)} with strides {tuple(strides)} is not C-contiguous; "
        "ferrodist works in place and will not silently copy (the result would be lost): "
        "pass np.ascontiguousarray(x) (or x.contiguous() in PyTorch) and read the result from that"
    )


def as_tensor(obj: object) -> Tensor:
    """View ``obj`` as a :class:`Tensor` without copying.

    Accepts a ``Tensor``, a numpy array, any object with the Python buffer protocol
    (``bytearray``, ``array.array``, ``memoryview``), a PyTorch tensor (CPU or CUDA, any
    dtype, bfloat16 included), a Numba device array, any object with
    ``__cuda_array_interface__`` (CuPy, PyTorch, Numba), or any object that exports DLPack
    on the CPU or a CUDA device. A collective that writes into the tensor writes into
    ``obj``'s memory.

    Raises:
        InvalidArgument: the object is not an array, its dtype is not supported, or it
            is not contiguous (a copy would lose the in-place result).
        DeviceUnavailable: the object lives on a GPU but no CUDA device (or simulator) is usable.
    """
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, np.ndarray):
        return Tensor(obj)
    module = type(obj).__module__.partition(".")[0]
    if module == "torch":
        return _from_torch(obj)
    if _cuda.is_device_array(obj):
        return Tensor.from_device_array(obj)
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return Tensor.from_device_array(_cuda.array_from_interface(obj, interface), source=obj)
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


def host_view(obj: object) -> np.ndarray[Any, Any] | None:
    """``obj``'s memory as a C-contiguous numpy array, found cheaply, when ``obj`` is an
    array in host memory that needs no closer look: a numpy array, a CPU :class:`Tensor`
    or a PyTorch CPU tensor (bfloat16 included, as ``bfloat16``). None for anything else,
    which :func:`as_tensor` then views (or explains why it cannot). The array's dtype may
    still be one ferrodist does not move: the caller checks that once through ``as_tensor``.
    """
    kind = type(obj)
    if kind is np.ndarray:
        return obj if obj.flags.c_contiguous else None  # type: ignore[attr-defined, return-value]
    if kind is Tensor:
        return None if obj.is_cuda else obj._array  # type: ignore[attr-defined]
    if kind.__module__.partition(".")[0] != "torch":
        return None
    return _torch_host(obj)


class _Holder:
    """What a numpy array over a torch tensor's memory keeps as its base: the tensor, or for
    an array that ``_VIEWS`` remembers its storage (either keeps the memory alive as long as
    the array), and the address, shape and type numpy reads."""

    __slots__ = ("__array_interface__", "owner")
    __array_interface__: dict[str, Any]
    owner: Any


#: torch dtype -> (the numpy type string of its memory, the dtype to view that as or None);
#: None for a dtype numpy cannot hold.
_HOST_FORMS: dict[Any, tuple[str, Any] | None] = {}
#: id(tensor) -> (a weak reference to it, its address, shape and dtype, the array over it):
#: the array made for a tensor, reused while the tensor keeps that address, shape and dtype. An entry
#: goes when its tensor does (and all of them past ``_MOST_VIEWS``); it holds the storage,
#: never the tensor, so it keeps nothing alive that its tensor would not.
_VIEWS: dict[int, tuple[Any, int, Any, Any, np.ndarray[Any, Any]]] = {}
#: id(tensor) -> address, for tensors seen once: a tensor is remembered the second time it
#: comes (a tensor made for one call, which most are not, costs no weak reference).
_SEEN_ONCE: dict[int, int] = {}
_MOST_VIEWS = 4096


def _host_form(torch_dtype: Any) -> tuple[str, Any] | None:
    torch = sys.modules["torch"]
    if torch_dtype == torch.bfloat16:
        form: tuple[str, Any] | None = ("<u2", bfloat16.numpy)  # numpy has no bfloat16: its bits, then viewed
    else:
        try:
            form = (torch.empty(0, dtype=torch_dtype).numpy().dtype.str, None)
        except (TypeError, RuntimeError):  # complex32, float8, quantized, ...
            form = None
    _HOST_FORMS[torch_dtype] = form
    return form


def _torch_host(obj: Any) -> np.ndarray[Any, Any] | None:
    """A CPU torch tensor's memory as a numpy array, read from its address.

    Not ``obj.numpy()``: that marks the tensor's storage as not resizable for good, and
    torch code that frees a buffer by resizing its storage to zero after a collective (FSDP
    does, between forward and backward) would then fail. ``requires_grad`` does not matter
    here (the memory is the same). A tensor that comes a third time at the same address with
    the same shape gets the array made the second time (a lookup, not a new array).
    """
    key = id(obj)
    seen = _VIEWS.get(key)
    try:
        kind = obj.dtype  # which ``tensor.data = ...`` can change, with the address and shape
        if seen is not None and seen[0]() is obj and obj.data_ptr() == seen[1] and obj.shape == seen[2]:
            if kind is seen[3] and obj.is_contiguous():
                return seen[4]
        form = _HOST_FORMS.get(kind, _HOST_FORMS)
        if form is _HOST_FORMS:
            form = _host_form(kind)
        if form is None or not obj.is_cpu or not obj.is_contiguous() or obj.is_conj() or obj.is_neg():
            return None
        # a tensor without storage (a wrapper subclass, fake or meta, mkldnn) raises here, and
        # layouts other than strided (sparse CSR) in ``is_contiguous``
        address = obj.data_ptr()
        if address == 0 and obj.numel():  # its storage was resized to nothing: no memory to view
            return None
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    typestr, view = form  # type: ignore[misc]
    holder = _Holder()
    shape = obj.shape
    holder.__array_interface__ = {"data": (address, False), "shape": tuple(shape), "typestr": typestr, "version": 3}
    again = _SEEN_ONCE.get(key) == address  # its second call: remember the array
    holder.owner = obj.untyped_storage() if again else obj
    array: np.ndarray[Any, Any] = np.asarray(holder)
    if view is not None:
        array = array.view(view)
    if again:
        _remember(obj, address, shape, kind, array)
    else:
        if len(_SEEN_ONCE) >= _MOST_VIEWS:
            _SEEN_ONCE.clear()
        _SEEN_ONCE[key] = address
    return array


def _remember(obj: Any, address: int, shape: Any, kind: Any, array: np.ndarray[Any, Any]) -> None:
    key = id(obj)

    def forget(ref: Any) -> None:
        seen = _VIEWS.get(key)
        if seen is not None and seen[0] is ref:
            del _VIEWS[key]

    try:
        ref = weakref.ref(obj, forget)
    except TypeError:  # a tensor type without weak references: nothing remembered
        return
    if len(_VIEWS) >= _MOST_VIEWS:
        _VIEWS.clear()
    _VIEWS[key] = (ref, address, shape, kind, array)


def device_view(obj: object) -> Tensor | None:
    """``obj`` as a CUDA :class:`Tensor`, found cheaply, when it is a CUDA ``Tensor``, a
    C-contiguous Numba device array, or a contiguous PyTorch CUDA tensor of a dtype
    ferrodist moves (viewed by its address: its Numba array is made only if something needs
    it). None for anything else, which :func:`as_tensor` then views or explains.
    """
    kind = type(obj)
    if kind is Tensor:
        return obj if obj.is_cuda else None  # type: ignore[attr-defined, return-value]
    module = kind.__module__.partition(".")[0]
    if module == "torch":
        if not getattr(obj, "is_cuda", False) or not obj.is_contiguous():  # type: ignore[attr-defined]
            return None
        dt = _torch_dtype(obj.dtype)  # type: ignore[attr-defined]
        if dt is None:
            return None
        shape = tuple(obj.shape)  # type: ignore[attr-defined]
        return Tensor._lazy(obj, dt, obj.device.index, shape, obj.data_ptr())  # type: ignore[attr-defined]
    if module in ("numba", "numba_cuda") and _cuda.is_device_array(obj) and obj.is_c_contiguous():  # type: ignore[attr-defined]
        try:
            return Tensor.from_device_array(obj)
        except InvalidArgument:
            return None
    return None


_TORCH_DTYPES: dict[Any, DType | None] = {}  # torch dtype -> ferrodist's (None: not moved)
_CUDA_DEVICES: dict[int, Device] = {}


def _torch_dtype(torch_dtype: Any) -> DType | None:
    found = _TORCH_DTYPES.get(torch_dtype, _TORCH_DTYPES)
    if found is _TORCH_DTYPES:
        try:
            found = dtype(str(torch_dtype).removeprefix("torch."))
        except InvalidArgument:
            found = None
        _TORCH_DTYPES[torch_dtype] = found
    return found  # type: ignore[return-value]


def _cuda_device(index: int) -> Device:
    found = _CUDA_DEVICES.get(index)
    if found is None:
        found = _CUDA_DEVICES[index] = Device("cuda", index)
    return found


def _from_dlpack(obj: Any) -> Tensor:
    device_type, _ = obj.__dlpack_device__()
    if device_type in (2, 13):  # kDLCUDA, kDLCUDAManaged
        _cuda.cuda("as_tensor of a CUDA DLPack array")
        interface, dt, capsule = _dlpack.cuda_interface(obj)
        return Tensor.from_device_array(_cuda.array_from_interface(capsule, interface), dtype=dt, source=obj)
    if device_type != 1:  # kDLCPU
        raise InvalidArgument(
            f"as_tensor: {type(obj).__name__} lives on DLPack device type {device_type}; "
            "ferrodist supports the CPU and CUDA devices"
        )
    try:
        array = np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError) as exc:
        raise InvalidArgument(f"as_tensor: numpy could not import {type(obj).__name__} through DLPack: {exc}") from exc
    return Tensor(array, source=obj)


def is_torch_module(obj: object) -> bool:
    """True for a PyTorch ``nn.Module`` (without importing torch: False when it is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _from_torch(obj: Any) -> Tensor:
    torch = sys.modules["torch"]
    if not obj.is_contiguous():
        raise InvalidArgument(_non_contiguous_message(tuple(obj.shape), tuple(obj.stride())))
    tensor = obj.detach()
    if obj.device.type == "cuda":
        # torch exports no bfloat16 through __cuda_array_interface__: move the bits as int16.
        bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        array = _cuda.array_from_interface(bits, bits.__cuda_array_interface__, obj.device.index)
        dt = "bfloat16" if tensor.dtype == torch.bfloat16 else None
        return Tensor.from_device_array(array, dtype=dt, source=obj)
    if obj.device.type != "cpu":
        raise InvalidArgument(f"as_tensor: a torch tensor on {obj.device} is not supported; use cpu or cuda")
    if tensor.dtype == torch.bfloat16:
        # numpy's DLPack import has no bfloat16: move the bits as int16, then reinterpret.
        array = np.from_dlpack(tensor.view(torch.int16)).view(dtype("bfloat16").numpy)
    else:
        try:
            array = np.from_dlpack(tensor)
        except (BufferError, TypeError, RuntimeError) as exc:
            raise InvalidArgument(f"as_tensor: a torch {tensor.dtype} tensor is not supported ({exc})") from exc
    return Tensor(array, source=obj)
