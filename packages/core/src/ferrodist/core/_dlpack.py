"""Reading a DLPack capsule of CUDA memory into a ``__cuda_array_interface__`` dict.

numpy imports CPU DLPack itself; for CUDA memory ferrodist reads the ``DLManagedTensor``
with ctypes (the layout is fixed by the DLPack ABI) and hands the pointer to Numba. The
capsule is kept alive by the tensor, and its own destructor calls the producer's deleter
once nothing uses the memory any more.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ._errors import InvalidArgument

__all__ = ["cuda_interface"]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# DLPack type code -> numpy kind letter (kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLBool).
_KINDS = {0: "i", 1: "u", 2: "f", 4: "bf", 6: "b"}

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def cuda_interface(obj: Any) -> tuple[dict[str, Any], str | None, Any]:
    """``(interface, dtype, capsule)`` for a DLPack producer on a CUDA device. ``dtype`` is
    ``"bfloat16"`` when the bits (typed uint16 in ``interface``) are bfloat16, else None."""
    try:
        capsule = obj.__dlpack__()
    except TypeError:
        capsule = obj.__dlpack__(stream=None)
    address = _get_pointer(capsule, b"dltensor")
    tensor = _DLTensor.from_address(address)
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    kind = _KINDS.get(code)
    if kind is None or lanes != 1 or bits % 8:
        raise InvalidArgument(f"as_tensor: DLPack dtype (code {code}, {bits} bits, {lanes} lanes) is not supported")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    itemsize = bits // 8
    strides = None
    if tensor.strides:
        strides = tuple(tensor.strides[i] * itemsize for i in range(tensor.ndim))
    dt = None
    if kind == "bf":
        if bits != 16:
            raise InvalidArgument(f"as_tensor: DLPack bfloat of {bits} bits is not supported")
        kind, dt = "u", "bfloat16"
    typestr = "|b1" if kind == "b" else f"<{kind}{itemsize}"
    interface = {
        "shape": shape,
        "typestr": typestr,
        "data": (int(tensor.data or 0) + int(tensor.byte_offset), False),
        "strides": strides,
        "version": 3,
    }
    return interface, dt, _Holder(capsule, interface)


class _Holder:
    """Keeps the capsule alive and shows Numba the memory it describes."""

    def __init__(self, capsule: Any, interface: dict[str, Any]) -> None:
        self.capsule = capsule
        self.__cuda_array_interface__ = interface
