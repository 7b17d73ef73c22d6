"""Call fingerprints: 64 bits that say which collective a message belongs to.

Every message of a collective carries its call's fingerprint, and the receiver compares
it with its own: ranks that disagree about the next call (another operation, dtype, size,
op or root) raise ``CollectiveMismatch`` naming what each called, instead of exchanging
bytes that mean different things.

    bits 60..63  operation (1..15; 0 = no fingerprint)
    bits 55..59  dtype index + 1 (0 = none)
    bits 51..54  reduce op value + 1 (0 = none)
    bits 40..50  root + 1 (0 = none; 2047 = a root of 2046 or more)
    bits  0..39  element count (modulo 2**40)
"""

from __future__ import annotations

from ferrodist.core import ALL_DTYPES, DType, ReduceOp

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
    # Calls made of several steps, each run as one call with a fingerprint of its own
    # (this takes codes 1..15, all the 4 bits hold: another one needs a wider field).
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "all_to_all_single",
    "monitored_barrier",
)
_OPERATION_CODE = {name: code for code, name in enumerate(OPERATIONS, start=1)}
_DTYPE_CODE = {dt.name: code for code, dt in enumerate(ALL_DTYPES, start=1)}
_COUNT_BITS = 40
#: The element count's bits of a fingerprint.
COUNT_MASK = (1 << _COUNT_BITS) - 1
_ROOT_LIMIT = 2047


def fingerprint(
    operation: str,
    dtype: DType | None = None,
    count: int = 0,
    op: ReduceOp | None = None,
    root: int | None = None,
) -> int:
    """The fingerprint of one call (as every rank of the call should compute it)."""
    value = _OPERATION_CODE[operation] << 60
    if dtype is not None:
        value |= _DTYPE_CODE[dtype.name] << 55
    if op is not None:
        value |= (op.value + 1) << 51
    if root is not None:
        value |= min(root + 1, _ROOT_LIMIT) << 40
    return value | (count & COUNT_MASK)


def describe(value: int) -> str:
    """A fingerprint as words, e.g. ``all_reduce(float32 x 100, op=SUM)``."""
    code = value >> 60
    if not 1 <= code <= len(OPERATIONS):
        return f"an unknown call (fingerprint {value:#x})"
    parts = []
    dtype_code = (value >> 55) & 0x1F
    if dtype_code:
        dtype_name = ALL_DTYPES[dtype_code - 1].name if dtype_code <= len(ALL_DTYPES) else "?"
        parts.append(f"{dtype_name} x {value & COUNT_MASK}")
    elif value & COUNT_MASK:  # a count without a dtype: broadcast_object_list's objects
        parts.append(f"{value & COUNT_MASK} items")
    op_code = (value >> 51) & 0xF
    if op_code:
        parts.append(f"op={ReduceOp(op_code - 1).name}" if op_code - 1 < len(ReduceOp) else "op=?")
    root = (value >> 40) & 0x7FF
    if root:
        parts.append(f"root={root - 1}" if root < _ROOT_LIMIT else "root>=2046")
    return f"{OPERATIONS[code - 1]}({', '.join(parts)})"
