"""The straggler report: who was slow, by how much, and what it cost the others.

Each rank times its own steps for free (a clock read when the step starts, when each
bucket's gradients are final, and around the wait for the averages). Ranks exchange those
timings only when asked (``DistributedDataParallel.stats()`` or every ``report_every``
steps), in one all_gather, so an ordinary step pays nothing for the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["StepStats", "StragglerReport", "summarize"]


@dataclass(frozen=True)
class StepStats:
    """One synchronised step, seen from every rank (times in seconds; NaN for a rank that
    had joined, i.e. run out of inputs, and only shadowed this step).

    ``ready[r][b]``: from the start of rank r's step (its forward) until bucket b's
    gradients were final there. ``compute[r]``: until its last bucket was final (its
    backward). ``wait[r]``: how long rank r then waited for the averages. ``slowest``:
    the rank with the longest compute, the one the others waited for.
    """

    step: int
    ready: tuple[tuple[float, ...], ...]
    compute: tuple[float, ...]
    wait: tuple[float, ...]
    slowest: int

    @property
    def lag(self) -> float:
        """How much longer the slowest rank computed than the fastest (seconds)."""
        live = [c for c in self.compute if not math.isnan(c)]
        return max(live) - min(live) if live else float("nan")


@dataclass(frozen=True)
class StragglerReport:
    """Every step exchanged so far (up to the ``history`` newest), oldest first."""

    steps: tuple[StepStats, ...]
    size: int

    def slowest_counts(self) -> list[int]:
        """How many steps each rank was the slowest in."""
        counts = [0] * self.size
        for s in self.steps:
            counts[s.slowest] += 1
        return counts

    def summary(self, last: int | None = None) -> str:
        """One line over the ``last`` steps (all by default)."""
        steps = self.steps[-last:] if last else self.steps
        if not steps:
            return "ddp: no synchronised steps yet"
        counts = [0] * self.size
        for s in steps:
            counts[s.slowest] += 1
        worst = int(np.argmax(counts))
        compute = np.nanmean(np.array([s.compute for s in steps], dtype=float), axis=0) * 1e3
        wait = np.nanmean(np.array([s.wait for s in steps], dtype=float), axis=0) * 1e3
        per_rank = " ".join(f"r{r} {compute[r]:.1f}/{wait[r]:.1f}" for r in range(self.size))
        return (
            f"ddp steps {steps[0].step}-{steps[-1].step}: slowest rank {worst} in {counts[worst]} of {len(steps)} steps; "
            f"compute/wait ms per step: {per_rank}"
        )


def summarize(first_step: int, rows: np.ndarray, buckets: int) -> list[StepStats]:
    """Turn gathered rows into steps. ``rows[r, k]`` is rank r's k-th step since the last
    exchange: ``[compute, wait, ready_0 .. ready_{buckets-1}]``."""
    out = []
    size, count = rows.shape[0], rows.shape[1]
    for k in range(count):
        compute = tuple(float(rows[r, k, 0]) for r in range(size))
        wait = tuple(float(rows[r, k, 1]) for r in range(size))
        ready = tuple(tuple(float(v) for v in rows[r, k, 2 : 2 + buckets]) for r in range(size))
        live = [(c, r) for r, c in enumerate(compute) if not math.isnan(c)]
        slowest = max(live)[1] if live else 0
        out.append(StepStats(step=first_step + k, ready=ready, compute=compute, wait=wait, slowest=slowest))
    return out
