"""ferrodist.core: the tensor type, dtypes, reduce ops, errors and reduction kernels
that every other ferrodist package builds on."""

from ._device import Device, device
from ._dtypes import (
    DType,
    bfloat16,
    bool_,
    dtype,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
    uint16,
    uint32,
    uint64,
)
from ._errors import (
    BackendUnavailable,
    CollectiveMismatch,
    CollectiveTimeout,
    DeviceUnavailable,
    FerrodistError,
    InvalidArgument,
    InvalidRank,
    NotInitialized,
    PeerLost,
    ProtocolError,
)
from ._group import Group, Work
from ._ops import ReduceOp
from ._reduce import reduce_into, reduce_many
from ._tensor import Tensor, as_tensor

__all__ = [
    "BackendUnavailable",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "DType",
    "Device",
    "DeviceUnavailable",
    "FerrodistError",
    "Group",
    "InvalidArgument",
    "InvalidRank",
    "NotInitialized",
    "PeerLost",
    "ProtocolError",
    "ReduceOp",
    "Tensor",
    "Work",
    "as_tensor",
    "bfloat16",
    "bool_",
    "device",
    "dtype",
    "float16",
    "float32",
    "float64",
    "int16",
    "int32",
    "int64",
    "int8",
    "reduce_into",
    "reduce_many",
    "uint16",
    "uint32",
    "uint64",
    "uint8",
]
