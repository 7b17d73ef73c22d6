"""Call fingerprints: 64 bits that say which collective a message belongs to.

Every message of a collective carries its call's fingerprint, and the receiver compares
it with its own: ranks that disagree about the next call (another operation, dtype, size,
op or root) raise ``CollectiveMismatch`` naming what each called, instead of exchanging
bytes that mean different things.

    bits 59..63  operation (1..31; 0 = no fingerprint)
    bits 54..58  dtype index + 1 (0 = none)
    bits 50..53  reduce op value + 1 (0 = none)
    bits 39..49  root + 1 (0 = none; 2047 = a root of 2046 or more); an all_reduce, which
                 has no root, that the transport reads in place has them all set (``IN_PLACE``)
    bit  38      the call runs device to device (NCCL): ranks on another route never match
    bits  0..37  element count (modulo 2**38)
"""

from __future__ import annotations

from ferrodist.core import ALL_DTYPES, DType, ReduceOp
from ferrodist.transport import IN_PLACE

OPERATIONS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "barrier",
    # Calls made of several steps, each run as one call with a fingerprint of its own.
    "all_to_all_single",
    "monitored_barrier",
    # A group's choice of engine for CUDA tensors, in its first call on them.
    "cuda_route",
)
_OPERATION_CODE = {name: code for code, name in enumerate(OPERATIONS, start=1)}
_DTYPE_CODE = {dt.name: code for code, dt in enumerate(ALL_DTYPES, start=1)}
_COUNT_BITS = 38
#: The element count's bits of a fingerprint.
COUNT_MASK = (1 << _COUNT_BITS) - 1
#: The bit that marks a call running device to device (the NCCL engine).
DIRECT = 1 << _COUNT_BITS
_ROOT_LIMIT = 2047


def fingerprint(
    operation: str,
    dtype: DType | None = None,
    count: int = 0,
    op: ReduceOp | None = None,
    root: int | None = None,
    *,
    direct: bool = False,
) -> int:
    """The fingerprint of one call (as every rank of the call should compute it)."""
    value = _OPERATION_CODE[operation] << 59
    if dtype is not None:
        value |= _DTYPE_CODE[dtype.name] << 54
    if op is not None:
        value |= (op.value + 1) << 50
    if root is not None:
        value |= min(root + 1, _ROOT_LIMIT) << 39
    if direct:
        value |= DIRECT
    return value | (count & COUNT_MASK)


def describe(value: int) -> str:
    """A fingerprint as words, e.g. ``all_reduce(float32 x 100, op=SUM)``."""
    code = value >> 59
    if not 1 <= code <= len(OPERATIONS):
        return f"an unknown call (fingerprint {value:#x})"
    parts = []
    dtype_code = (value >> 54) & 0x1F
    if dtype_code:
        dtype_name = ALL_DTYPES[dtype_code - 1].name if dtype_code <= len(ALL_DTYPES) else "?"
        parts.append(f"{dtype_name} x {value & COUNT_MASK}")
    elif value & COUNT_MASK:  # a count without a dtype: broadcast_object_list's objects
        parts.append(f"{value & COUNT_MASK} items")
    op_code = (value >> 50) & 0xF
    if op_code:
        parts.append(f"op={ReduceOp(op_code - 1).name}" if op_code - 1 < len(ReduceOp) else "op=?")
    root = (value >> 39) & 0x7FF
    if code == _OPERATION_CODE["all_reduce"] and (value & IN_PLACE) == IN_PLACE:
        parts.append("its array in the group's shared memory, read in place")
    elif root:
        parts.append(f"root={root - 1}" if root < _ROOT_LIMIT else "root>=2046")
    if value & DIRECT:
        parts.append("device to device through NCCL")
    return f"{OPERATIONS[code - 1]}({', '.join(parts)})"


def nbytes(value: int) -> int:
    """The bytes a fingerprint's call moves per rank (its dtype's size times its count; 0
    when it names no dtype)."""
    dtype_code = (value >> 54) & 0x1F
    if not 1 <= dtype_code <= len(ALL_DTYPES):
        return 0
    return ALL_DTYPES[dtype_code - 1].itemsize * (value & COUNT_MASK)
