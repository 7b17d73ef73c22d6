"""After a timeout: which ranks never reached the call?

Each rank whose call timed out checks in under ``ferrodist/late/<group>/<call>/<rank>``
in the job's store and waits a moment for the others to do the same. A member that
never checks in never got to the call (or is stuck before it): those are the ranks the
timeout names. This costs nothing until a call times out, and never more than ``grace``
seconds then, whether or not the store answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ferrodist.core import FerrodistError
from ferrodist.transport import Transport


def absent_ranks(
    transport: Transport, group_id: int, seq: int, members: Sequence[int], grace: float
) -> list[int] | None:
    """Global ranks of ``members`` that did not check in within ``grace`` seconds, or
    ``None`` when the transport has no store or the store cannot be reached."""
    try:
        store = getattr(transport, "store", None)
    except FerrodistError:
        return None
    if store is None:
        return None
    prefix = f"ferrodist/late/{group_id}/{seq}/"
    keys = {rank: f"{prefix}{rank}" for rank in members}
    deadline = time.monotonic() + grace  # a store that does not answer (rank 0 stopped) costs no more

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    try:
        store.set(keys[transport.rank], b"", timeout=left())
        try:
            store.wait(list(keys.values()), timeout=left())
            return []
        except FerrodistError:
            pass
        return [rank for rank, key in keys.items() if not store.check([key], timeout=max(0.05, left()))]
    except FerrodistError:
        return None
