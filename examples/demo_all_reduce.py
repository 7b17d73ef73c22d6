"""all_reduce across 4 simulated ranks (threads of this process) on real arrays (no launcher needed).

Each rank fills a float32 array with its own integer-valued data, all_reduces it (sum),
and checks the result against a numpy reference computed from every rank's input.
Prints, per size: the median time of one all_reduce, and the check.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import ferrodist.collectives as dist
from ferrodist.testing import run_world

WORLD = 4
SIZES = [4 << 10, 256 << 10, 4 << 20, 64 << 20]  # bytes per rank
REPEATS = 5


def rank_input(rank: int, count: int) -> np.ndarray:
    # Small integers: float32 sums of them are exact, so the check can demand equality.
    return ((np.arange(count, dtype=np.int64) * (rank + 1)) % 251).astype(np.float32)


def rank_main(count: int) -> tuple[list[float], bool]:
    rank = dist.get_rank()
    x = rank_input(rank, count)
    times = []
    for _ in range(REPEATS):
        x[...] = rank_input(rank, count)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    expected = sum(rank_input(r, count) for r in range(WORLD))
    return times, bool(np.array_equal(x, expected))


def main() -> None:
    print(f"all_reduce(SUM) of float32 arrays across {WORLD} simulated ranks (threads), median of {REPEATS}")
    print(f"{'size per rank':>14} {'time':>11} {'check':>6}")
    failures = 0
    for nbytes in SIZES:
        results = run_world(WORLD, rank_main, nbytes // 4)
        # A call is as slow as its slowest rank.
        per_call = [max(r[0][i] for r in results) for i in range(REPEATS)]
        ok = all(r[1] for r in results)
        failures += not ok
        median_ms = statistics.median(per_call) * 1e3
        print(f"{nbytes >> 10:>10} KiB {median_ms:>8.2f} ms {'ok' if ok else 'FAIL':>6}")
    if failures:
        raise SystemExit(f"{failures} size(s) gave a wrong result")


if __name__ == "__main__":
    main()
