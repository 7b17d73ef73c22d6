"""Checks every transport applies: peers, tags, buffers, and a message against its receive."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ferrodist.core import CollectiveMismatch, CollectiveTimeout, FerrodistError, InvalidArgument, InvalidRank

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


def check_sources(rank: int, world_size: int, sources: object) -> tuple[int, ...]:
    """The senders a receive from any of several may take its message from: other ranks
    of the world, at least one, each once."""
    peers = tuple(check_peer(rank, world_size, peer, "recv from any source") for peer in sources)  # type: ignore[attr-defined]
    if not peers or len(set(peers)) != len(peers):
        raise InvalidArgument(
            f"rank {rank}: recv from any source: the senders must be distinct ranks, at least one, not {list(peers)}"
        )
    return peers


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


def receiving(pending: Any, what: str = "receive") -> str:
    """``what`` and whom a receive (``src``, or ``sources`` when from any of several) takes
    its message from, for messages."""
    if pending.sources is None:
        return f"{what} from rank {pending.src}"
    return f"{what} from any of ranks {list(pending.sources)} (tag {pending.tag:#x})"


def lost_sender(lost: Mapping[int, FerrodistError], senders: tuple[int, ...]) -> FerrodistError | None:
    """What ends a receive from ``senders`` that are gone (``lost``: each gone rank's error):
    the first one that failed; or, once every one has closed its transport on purpose
    (``PeerLost.finished``), the last one's. None while one of them may still send (a
    receive from any of several waits on for the others when one finishes)."""
    gone = [lost[peer] for peer in senders if peer in lost]
    failed = next((error for error in gone if not getattr(error, "finished", False)), None)
    return failed or (gone[-1] if gone and len(gone) == len(senders) else None)


def receive_timeout(rank: int, src: int | tuple[int, ...], tag: int, limit: float) -> CollectiveTimeout:
    """The error of a receive whose message did not come in time (``src``: the sender, or
    the senders a receive from any of several waited for)."""
    if isinstance(src, tuple):
        if len(src) == 1:
            src = src[0]
        else:
            return CollectiveTimeout(
                f"rank {rank} waited {limit:g} s for a message from any of ranks {list(src)} (tag {tag:#x}) and "
                "none came: none of them has reached its send, or they are stuck (raise the timeout if they are "
                "only slow)",
                rank=rank,
                waiting_for=src,
            )
    return CollectiveTimeout(
        f"rank {rank} waited {limit:g} s for a message from rank {src} (tag {tag:#x}) that never came: "
        f"rank {src} has not reached the matching call, is stuck, or is itself waiting on another rank "
        "(raise the timeout if it is only slow)",
        rank=rank,
        waiting_for=(src,),
    )
