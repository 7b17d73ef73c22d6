"""Run with `ferrodist run -n 2 examples/all_reduce_ranks.py` (make demo does).

Each rank is a real process connected to the others over TCP. Every rank all_reduces
float32 arrays of several sizes, checks the result against what every rank contributed,
and prints one line per size: the median time of one all_reduce and the check.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import ferrodist.collectives as dist

SIZES = [4 << 10, 1 << 20, 16 << 20, 64 << 20]  # bytes per rank
REPEATS = 5


def contribution(rank: int, count: int) -> np.ndarray:
    # Small integers: float32 sums of them are exact, so the check can demand equality.
    return ((np.arange(count, dtype=np.int64) * (rank + 1)) % 251).astype(np.float32)


def main() -> None:
    world = dist.init_process_group("tcp", timeout=60)
    rank, size = world.rank, world.size
    try:
        for nbytes in SIZES:
            count = nbytes // 4
            expected = sum(contribution(r, count) for r in range(size))
            times = []
            ok = True
            for _ in range(REPEATS):
                x = contribution(rank, count)
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - start)
                ok = ok and bool(np.array_equal(x, expected))
            verdict = "ok" if ok else "WRONG"
            print(
                f"all_reduce {nbytes >> 10:>6} KiB x {size} ranks: {statistics.median(times) * 1e3:8.2f} ms  {verdict}"
            )
            if not ok:
                raise SystemExit(f"rank {rank}: wrong all_reduce result for {nbytes} bytes")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
