"""Checks every transport applies: peers, tags, buffers, and a message against its receive."""

from __future__ import annotations

from typing import Any

import numpy as np

from ferrodist.core import CollectiveMismatch, CollectiveTimeout, InvalidArgument, InvalidRank

Buffer = np.ndarray[Any, Any]


def check_peer(rank: int, world_size: int, peer: object, what: str) -> int:
    """``peer`` as an int, or ``InvalidRank`` if it is not another rank of the world."""
    if peer.__class__ is int and 0 <= peer < world_size and peer != rank:  # type: ignore[operator]
        return peer  # type: ignore[return-value]
    if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool):
        raise InvalidRank(f"rank {rank}: {what} needs an integer rank, not {peer!r}", rank=rank)
    peer = int(peer)
    if not 0 <= peer < world_size:
        raise InvalidRank(
            f"rank {rank}: {what} names rank {peer}, outside this world of {world_size} ranks "
            f"(valid: 0..{world_size - 1})",
            rank=rank,
        )
    if peer == rank:
        raise InvalidRank(f"rank {rank}: {what} names itself; copy the data locally instead", rank=rank)
    return peer


def check_tag(tag: object, what: str) -> int:
    if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool) or not 0 <= tag < 1 << 64:
        raise InvalidArgument(f"{what}: tag must be an integer in 0..2**64-1, not {tag!r}")
    return int(tag)


def as_bytes(buf: object, what: str, *, writeable: bool = False, rank: int | None = None) -> Buffer:
    """A flat uint8 view of a C-contiguous numpy array (no copy)."""
    if not isinstance(buf, np.ndarray):
        raise InvalidArgument(f"{what}: the buffer must be a numpy array, not {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise InvalidArgument(f"{what}: the buffer must be C-contiguous")
    if writeable and not buf.flags.writeable:
        raise InvalidArgument(f"rank {rank}: {what} into a read-only buffer")
    return (buf if buf.ndim == 1 else buf.reshape(-1)).view(np.uint8)


def check_match(
    rank: int, src: int, tag: int, expected_bytes: int, expected_fp: int, got_bytes: int, got_fp: int
) -> CollectiveMismatch | None:
    """The error for a message that does not fit its receive, or ``None`` if it fits.

    A fingerprint mismatch is reported first: it says more (which call each rank made)
    than the byte counts do.
    """
    if expected_fp and got_fp and expected_fp != got_fp:
        return CollectiveMismatch(
            f"rank {rank} received a message from rank {src} (tag {tag:#x}) that belongs to a different "
            "call than the one this rank is in",
            rank=rank,
            peer=src,
            expected=expected_fp,
            received=got_fp,
        )
    if got_bytes != expected_bytes:
        return CollectiveMismatch(
            f"rank {rank} expected {expected_bytes} bytes from rank {src} (tag {tag:#x}) but rank {src} sent "
            f"{got_bytes}: the two ranks passed tensors of different sizes or dtypes to the same call",
            rank=rank,
            peer=src,
            expected=expected_fp,
            received=got_fp,
        )
    return None


def receive_timeout(rank: int, src: int, tag: int, limit: float) -> CollectiveTimeout:
    """The error of a receive whose message did not come in time."""
    return CollectiveTimeout(
        f"rank {rank} waited {limit:g} s for a message from rank {src} (tag {tag:#x}) that never came: "
        f"rank {src} has not reached the matching call, is stuck, or is itself waiting on another rank "
        "(raise the timeout if it is only slow)",
        rank=rank,
        waiting_for=(src,),
    )
