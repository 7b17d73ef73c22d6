"""The error file: how a rank tells its launcher whether it failed on its own or because of
another rank, so that ``ferrodist run`` blames the root cause, not the first rank to exit.

When ``FERRODIST_ERROR_FILE`` is set (``ferrodist run`` sets it for every rank), the first
ferrodist error that reaches the caller, from ``init_process_group``, a collective or a
point-to-point call, is written there as one JSON object::

    {"error": "PeerLost", "blames": [1], "rank": 0, "message": "rank 0: all_reduce #3 ...", "at": 1.7e9}

``blames`` lists the other ranks the error is about: the peer a ``PeerLost`` lost, the
ranks a ``CollectiveTimeout`` waited for; ``at`` is when (``time.time()``), so that a rank
that froze and raised its own error after it resumed is known by the others having
blamed it first. An error that blames no other rank (a mismatch,
a bad argument) is the rank's own. Only the first error is kept: later ones usually
follow from it. Writing never raises; the file appears whole or not at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from ferrodist.core import CollectiveTimeout, FerrodistError, PeerLost

__all__ = ["record_failure"]


def record_failure(error: FerrodistError) -> None:
    """Write ``error`` to ``FERRODIST_ERROR_FILE``, unless the variable is unset or this
    process already wrote its first error there."""
    path = os.environ.get("FERRODIST_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    rank = error.rank
    if rank is None and os.environ.get("RANK", "").isdigit():
        rank = int(os.environ["RANK"])
    if isinstance(error, PeerLost):
        blames: tuple[int, ...] = (error.peer,)
    elif isinstance(error, CollectiveTimeout):
        blames = error.waiting_for
    else:
        blames = ()
    origin = error.aborted_by
    if not blames and origin is not None:  # it came in another rank's abort notice
        blames = (origin,)
    record = {
        "error": type(error).__name__,
        "blames": [int(r) for r in blames if r != rank and r >= 0],
        "rank": rank,
        "message": error.message,
        "at": time.time(),
    }
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.link(partial, path)  # fails if an earlier error is there: the first one stays
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)
