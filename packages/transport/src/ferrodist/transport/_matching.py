"""The check every transport applies when a message meets the receive it matched."""

from __future__ import annotations

from ferrodist.core import CollectiveMismatch


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
