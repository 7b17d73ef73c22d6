"""Which algorithm runs a call: a table by message size, overridable per call."""

from __future__ import annotations

from ferrodist.core import InvalidArgument

#: all_reduce algorithms by name.
ALL_REDUCE_ALGORITHMS = ("recursive_doubling", "ring")

#: At or below this many bytes, all_reduce uses recursive doubling (log2 p steps of the
#: whole message); above it, the ring (2(p-1) steps of 1/p of the message each).
SMALL_MESSAGE_BYTES = 64 * 1024


def all_reduce_algorithm(nbytes: int, size: int, requested: str | None, *, rank: int) -> str:
    if requested is None or requested == "auto":
        return "recursive_doubling" if nbytes <= SMALL_MESSAGE_BYTES or size == 1 else "ring"
    if requested not in ALL_REDUCE_ALGORITHMS:
        choices = ", ".join(repr(a) for a in ("auto", *ALL_REDUCE_ALGORITHMS))
        raise InvalidArgument(
            f"rank {rank}: all_reduce: algorithm={requested!r} is unknown; use one of {choices}",
            rank=rank,
            operation="all_reduce",
        )
    return requested
