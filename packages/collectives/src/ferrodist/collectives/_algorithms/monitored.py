"""``monitored_barrier``: a barrier through group rank 0 that names the ranks that did not come.

Every other rank sends rank 0 a token and waits for its answer; rank 0 waits for all
the tokens until the call's deadline and answers only when all have come. When some
have not, rank 0 raises ``CollectiveTimeout`` naming them (the first, or all of them
with ``wait_all_ranks``), and its failure aborts the group, so the ranks waiting for
the answer raise at once with rank 0's words, and a latecomer raises ``GroupAborted``
when it arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ferrodist.collectives._call import Call
from ferrodist.core import CollectiveTimeout

_TOKEN = np.ones(1, np.uint8)


def body(ranks: Sequence[int], limit: float, wait_all_ranks: bool) -> Callable[[Call], None]:
    """The body of one ``monitored_barrier`` call of a group of ``ranks`` (global ranks),
    whose deadline is ``limit`` seconds."""

    def run(call: Call) -> None:
        if call.size == 1:
            return
        token = call.scratch.get(0, call.size, np.dtype(np.uint8))
        if call.rank != 0:
            call.send(_TOKEN, 0)
            call.recv(token[:1], 0)
            return
        requests = [(peer, call.irecv(token[peer : peer + 1], peer)) for peer in range(1, call.size)]
        missing = []
        for peer, request in requests:
            try:
                request.wait(max(0.0, call.deadline - time.monotonic()))
            except CollectiveTimeout:
                missing.append(ranks[peer])
        if missing:
            named = missing if wait_all_ranks else missing[:1]
            who = f"rank {named[0]}" if len(named) == 1 else f"ranks {named}"
            raise CollectiveTimeout(
                f"{who} did not arrive within {limit:g} s"
                + ("" if wait_all_ranks or len(missing) == 1 else " (pass wait_all_ranks=True to hear of all)"),
                rank=ranks[0],
                operation="monitored_barrier",
                waiting_for=tuple(named),
            )
        call.wait_all([call.isend(_TOKEN, peer) for peer in range(1, call.size)])

    return run
