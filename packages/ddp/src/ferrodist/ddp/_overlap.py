"""``overlap="auto"``: whether buckets start during backward or after it, chosen by timing both.

Starting a bucket's average while backward still runs hides the communication when the
machine has a core to spare for it; when it has none (as many busy ranks as cores), the
communication thread takes time from backward and overlapping can be slower. Which one
wins depends on the machine, the model and the batch, so it is measured: after
``WARMUP`` synchronised steps, the next ``2 * TRIALS`` alternate between overlapping and
not, each step timed from its forward to the end of its averaging; then the way with the
lower median step stays. Either way every rank issues the same collectives in the same
order, so ranks that choose differently still agree on every call.
"""

from __future__ import annotations

import statistics

__all__ = ["OverlapChoice"]

#: Synchronised steps before the trials (first steps allocate buffers, load kernels).
WARMUP = 2
#: Timed steps of each way.
TRIALS = 4


class OverlapChoice:
    """Which way the next synchronised step goes, and the choice once the trials are in."""

    def __init__(self) -> None:
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.steps = 0
        self.chosen: bool | None = None

    def next(self) -> bool:
        """True: the coming step starts buckets during backward."""
        if self.chosen is not None:
            return self.chosen
        trial = self.steps - WARMUP
        return trial < 0 or trial % 2 == 0

    def record(self, overlapped: bool, seconds: float) -> None:
        """A synchronised step that went ``overlapped`` took ``seconds``."""
        self.steps += 1
        if self.chosen is not None or self.steps <= WARMUP:
            return
        self.times[overlapped].append(seconds)
        if min(len(t) for t in self.times.values()) >= TRIALS:
            self.chosen = statistics.median(self.times[True]) <= statistics.median(self.times[False])
