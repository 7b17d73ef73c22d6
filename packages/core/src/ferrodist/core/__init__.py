"""ferrodist.core: the tensor type, dtypes, reduce ops, errors and reduction kernels
that every other ferrodist package builds on."""

from ._device import Device, device
from ._dtypes import (
    ALL_DTYPES,
    DType,
    bfloat16,
    bool_,
    check_op,
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
from ._reduce import reduce_into, reduce_many, reducer
from ._tensor import Tensor, as_tensor

__all__ = [
    "ALL_DTYPES",
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
    "check_op",
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
    "reducer",
    "uint16",
    "uint32",
    "uint64",
    "uint8",
]
