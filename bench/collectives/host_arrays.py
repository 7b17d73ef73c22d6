"""The cost of a collective on torch CPU tensors against the same on numpy arrays: one
job, interleaved rounds.

    ferrodist run -n 2 bench/collectives/host_arrays.py [--sizes 4096,65536] [--rounds 5] [--calls 20000]

Each rank times ``ferrodist.collectives.all_reduce`` (float32, SUM) on a numpy array and on
a torch tensor of the same bytes, ``--calls`` calls each, in rounds that alternate which
goes first; a round's figure is the slowest rank's mean call. Rank 0 prints, per size, the
median over the rounds and the ratio torch / numpy (1.00: no cost of its own). Needs torch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

import ferrodist.collectives as dist


def mean_call(x: Any, calls: int) -> float:
    """The slowest rank's mean time of one all_reduce of ``x`` (seconds)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(x)
    took = np.array([(time.perf_counter() - start) / calls])
    dist.all_reduce(took, "max")
    return float(took[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,65536", help="bytes per tensor, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("host_arrays.py needs torch: pip install torch", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    group = dist.init_process_group()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        arrays = {"numpy": np.ones(size // 4, np.float32), "torch": torch.ones(size // 4)}
        for x in arrays.values():  # warm: plans made, kernels compiled
            for _ in range(200):
                dist.all_reduce(x)
        got: dict[str, list[float]] = {name: [] for name in arrays}
        for r in range(args.rounds):
            order = list(arrays) if r % 2 == 0 else list(reversed(arrays))
            for name in order:
                got[name].append(mean_call(arrays[name], args.calls))
        numpy_us = statistics.median(got["numpy"]) * 1e6
        torch_us = statistics.median(got["torch"]) * 1e6
        rows.append((size, numpy_us, torch_us))
    if group.rank == 0:
        transport = type(group.transport).__name__
        print(f"all_reduce float32 SUM, {group.size} ranks over {transport}, median of {args.rounds} rounds")
        print("| size | numpy array | torch CPU tensor | torch / numpy |")
        print("|---|---|---|---|")
        for size, numpy_us, torch_us in rows:
            print(f"| {size // 1024} KiB | {numpy_us:.2f} us | {torch_us:.2f} us | {torch_us / numpy_us:.2f}x |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
