"""The one dtype table: numpy type, NCCL enum and the reduce ops each dtype supports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import InvalidArgument
from ._ops import ReduceOp

__all__ = [
    "ALL_DTYPES",
    "DType",
    "bfloat16",
    "bool_",
    "check_op",
    "dtype",
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "uint8",
]

_ARITH = frozenset({ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX})
_FLOAT_OPS = _ARITH | {ReduceOp.AVG}
_INT_OPS = _ARITH | {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}


@dataclass(frozen=True, eq=False)
class DType:
    """One element type ferrodist can move and reduce.

    Attributes:
        name: canonical name (``"bfloat16"``).
        numpy: the numpy dtype of arrays of this type.
        kind: ``"bool"``, ``"int"``, ``"uint"`` or ``"float"``.
        nccl: the ``ncclDataType_t`` value, or ``None`` where NCCL has no such type.
        ops: the reduce ops this dtype supports.
        itemsize: bytes per element.
    """

    name: str
    _numpy: np.dtype[Any] | None  # None: ml_dtypes' type of this name, imported on first use
    kind: str
    nccl: int | None
    ops: frozenset[ReduceOp]
    itemsize: int

    @property
    def numpy(self) -> np.dtype[Any]:
        found = self._numpy
        if found is None:
            # ml_dtypes takes ~0.1 s to import: only a program that uses bfloat16 pays for it.
            import ml_dtypes

            found = np.dtype(getattr(ml_dtypes, self.name))
            object.__setattr__(self, "_numpy", found)
        return found

    @property
    def is_floating(self) -> bool:
        return self.kind == "float"

    def __repr__(self) -> str:
        return f"ferrodist.{self.name}"

    def __reduce__(self) -> Any:
        return (dtype, (self.name,))


def _of(np_type: Any, name: str, kind: str, nccl: int | None, ops: frozenset[ReduceOp]) -> DType:
    numpy_dtype = np.dtype(np_type)
    return DType(name, numpy_dtype, kind, nccl, ops, numpy_dtype.itemsize)


bool_ = _of(np.bool_, "bool", "bool", 1, _INT_OPS)
int8 = _of(np.int8, "int8", "int", 0, _INT_OPS)
uint8 = _of(np.uint8, "uint8", "uint", 1, _INT_OPS)
int16 = _of(np.int16, "int16", "int", None, _INT_OPS)
uint16 = _of(np.uint16, "uint16", "uint", None, _INT_OPS)
int32 = _of(np.int32, "int32", "int", 2, _INT_OPS)
uint32 = _of(np.uint32, "uint32", "uint", 3, _INT_OPS)
int64 = _of(np.int64, "int64", "int", 4, _INT_OPS)
uint64 = _of(np.uint64, "uint64", "uint", 5, _INT_OPS)
float16 = _of(np.float16, "float16", "float", 6, _FLOAT_OPS)
bfloat16 = DType("bfloat16", None, "float", 9, _FLOAT_OPS, 2)
float32 = _of(np.float32, "float32", "float", 7, _FLOAT_OPS)
float64 = _of(np.float64, "float64", "float", 8, _FLOAT_OPS)

ALL_DTYPES: tuple[DType, ...] = (
    bool_,
    int8,
    uint8,
    int16,
    uint16,
    int32,
    uint32,
    int64,
    uint64,
    float16,
    bfloat16,
    float32,
    float64,
)
_BY_NAME = {d.name: d for d in ALL_DTYPES}
_BY_NUMPY = {d.numpy: d for d in ALL_DTYPES if d is not bfloat16}
_SUPPORTED = ", ".join(d.name for d in ALL_DTYPES)


def dtype(value: object) -> DType:
    """The :class:`DType` for a name, a numpy dtype or type, or a ``DType``.

    >>> dtype("bfloat16").itemsize
    2
    """
    if isinstance(value, DType):
        return value
    if isinstance(value, str) and value in _BY_NAME:
        return _BY_NAME[value]
    try:
        as_numpy = np.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        found = None
    else:
        found = _BY_NUMPY.get(as_numpy)
        if found is None and as_numpy.name == "bfloat16" and as_numpy == bfloat16.numpy:
            found = bfloat16
    if found is None:
        raise InvalidArgument(f"dtype {value!r} is not supported; ferrodist supports {_SUPPORTED}")
    return found


def check_op(op: ReduceOp, dt: DType, *, operation: str, rank: int | None = None) -> None:
    """Raise ``InvalidArgument`` before any byte moves if ``op`` does not apply to ``dt``."""
    if op in dt.ops:
        return
    where = f"rank {rank}: " if rank is not None else ""
    if op is ReduceOp.AVG:
        hint = "AVG is defined for floating dtypes only; use SUM and divide, or convert to float first"
    else:
        hint = f"{op.name} is bitwise and needs an integer or bool dtype; use a view as a same-sized integer type"
    raise InvalidArgument(
        f"{where}{operation}: ReduceOp.{op.name} does not apply to {dt.name} tensors ({hint})",
        rank=rank,
        operation=operation,
    )
