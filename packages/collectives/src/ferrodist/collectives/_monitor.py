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

import numpy as np

from ferrodist.core import CollectiveTimeout

from ._call import Call
from ._checks import Checker
from ._fingerprint import fingerprint
from ._runner import Runner
from ._timeouts import Timeout

_TOKEN = np.ones(1, np.uint8)


class MonitoredBarrier:
    """``ProcessGroup.monitored_barrier`` (a mixin over the group's checks and runner)."""

    _runner: Runner
    _ranks: tuple[int, ...]

    def _checker(self, operation: str) -> Checker:
        raise NotImplementedError

    def monitored_barrier(self, *, timeout: Timeout = None, wait_all_ranks: bool = False) -> None:
        """Return once every rank of the group has entered; otherwise raise on every rank,
        within ``timeout`` (seconds or a ``timedelta``; default the group's) plus a second,
        with group rank 0 naming the ranks that did not arrive.

        Example (rank 2 of 3 never calls it)::

            group.monitored_barrier(timeout=5)
            # rank 0: CollectiveTimeout: ... rank 2 did not arrive within 5 s ...
            # rank 1: CollectiveTimeout: ... rank 0 aborted the group after a failure there: ...
        """
        self._checker("monitored_barrier")
        if not isinstance(wait_all_ranks, bool):
            raise self._checker("monitored_barrier").fail(
                f"wait_all_ranks must be True or False, not {wait_all_ranks!r}"
            )
        limit = self._runner.limit(timeout, "monitored_barrier")
        ranks = self._ranks

        def body(call: Call) -> None:
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

        self._runner.launch("monitored_barrier", body, fingerprint("monitored_barrier"), async_op=False, timeout=limit)
