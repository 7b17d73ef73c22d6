"""Timeouts as the caller gives them: seconds (an int or a float) or a ``datetime.timedelta``.

Every call that takes a timeout (``init_process_group``, ``new_group``, the collectives,
point to point, ``Work.wait``) turns it into seconds here, so a timeout means the same
thing, and is refused with the same words, wherever it is passed.
"""

from __future__ import annotations

import datetime
import math

from ferrodist.core import InvalidArgument

__all__ = ["Timeout", "seconds"]

#: What a ``timeout=`` argument may be: seconds, a ``datetime.timedelta``, or None (the default).
Timeout = float | datetime.timedelta | None


def seconds(timeout: object, operation: str, *, rank: int | None = None, zero: bool = False) -> float:
    """``timeout`` as a positive, finite number of seconds.

    Args:
        timeout: seconds (``int`` or ``float``) or a ``datetime.timedelta``.
        operation: the call it was given to (for the error message).
        rank: the rank that called it, when there is one yet.
        zero: whether 0 is allowed (``Work.wait(0)`` looks without waiting).

    Raises:
        InvalidArgument: not a number or a timedelta; negative, zero (unless ``zero``),
            infinite or NaN.

    Example::

        seconds(datetime.timedelta(minutes=2), "all_reduce")   # 120.0
    """
    if isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise _refused(timeout, operation, rank, zero, f"not a {type(timeout).__name__}")
    if math.isnan(value):
        raise _refused(timeout, operation, rank, zero, "not NaN")
    if math.isinf(value):
        raise _refused(timeout, operation, rank, zero, "not endless: every wait needs an end")
    if value < 0 or (value == 0 and not zero):
        raise _refused(timeout, operation, rank, zero, f"not {value:g} s")
    return value


def _refused(timeout: object, operation: str, rank: int | None, zero: bool, why: str) -> InvalidArgument:
    where = f"rank {rank}: {operation}" if rank is not None else operation
    kind = "a number of seconds >= 0" if zero else "a positive number of seconds"
    return InvalidArgument(
        f"{where}: timeout must be {kind} or a datetime.timedelta, {why} (timeout={timeout!r}); "
        "e.g. timeout=30 or timeout=datetime.timedelta(seconds=30)",
        rank=rank,
        operation=operation,
    )
