"""float32 all_reduce sent as bfloat16 (``compress="bf16"``) against the plain float32 call
and against a bfloat16 array of the same length, in one job, interleaved.

    ferrodist run -n 2 bench/collectives/compressed.py [--mib 64] [--rounds 16] [--calls 4]

Each round times ``--calls`` back-to-back all_reduce(AVG) calls of each of the three, after
one untimed call of each and a wait for their compiled loops; the table gives each one's
fastest and median round (rank 0's), and the compressed call's ratio to the float32 one.
Over shm the compressed call rounds into bfloat16 slots and widens back inside its loop;
over tcp it rounds, runs the bfloat16 call and widens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import bfloat16
from ferrodist.core.kernels import wait_for_compiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64.0, help="float32 MiB per rank (default 64)")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group(timeout=120)
    n = int(args.mib * (1 << 20)) // 4
    cases = {
        "float32": (np.ones(n, np.float32), {}),
        "float32, compress='bf16'": (np.ones(n, np.float32), {"compress": "bf16"}),
        "bfloat16 array": (np.ones(n, bfloat16.numpy), {}),
    }
    for x, options in cases.values():
        dist.all_reduce(x, "avg", **options)
    wait_for_compiles(600)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (x, options) in cases.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                dist.all_reduce(x, "avg", **options)
            times[name].append((time.perf_counter() - start) / args.calls)
    if dist.get_rank() == 0:
        base = statistics.median(times["float32"])
        print(f"all_reduce(AVG) of {n} elements, {dist.get_world_size()} ranks, {args.rounds} rounds")
        print("| call | fastest | median | median / float32's |")
        print("|---|---|---|---|")
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"| {name} | {min(seconds) * 1e3:.2f} ms | {median * 1e3:.2f} ms | {median / base:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
