"""What a new group costs: ``torch.distributed.new_group`` and the first all_reduce on it,
over the "ferrodist" backend and over Gloo, in one job.

    torchrun --nproc-per-node 2 bench/torch/new_group.py [--rounds 5]
    ferrodist run -n 2 bench/torch/new_group.py [--rounds 5]

The default group is ferrodist's. Each round makes one ferrodist group and one Gloo group
over every rank (alternating which comes first) and times, on each, ``new_group`` plus one
all_reduce of four floats; a round's figure is the slowest rank's. Rank 0 prints each
backend's median over the rounds. A ferrodist group after the default one shares its
transport (no sockets, no arena), so it costs a few messages; a Gloo group connects anew.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ferrodist.torch  # noqa: F401  (registers "ferrodist")


def first_call(backend: str) -> float:
    """new_group over every rank, then one all_reduce on it: the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    group = dist.new_group(list(range(dist.get_world_size())), backend=backend)
    x = torch.ones(4)
    dist.all_reduce(x, group=group)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    assert x.tolist() == [float(dist.get_world_size())] * 4, x
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    dist.destroy_process_group(group)
    return float(took.item())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("ferrodist")
    got: dict[str, list[float]] = {"ferrodist": [], "gloo": []}
    for r in range(args.rounds):
        for backend in ("ferrodist", "gloo") if r % 2 == 0 else ("gloo", "ferrodist"):
            got[backend].append(first_call(backend))
    if dist.get_rank() == 0:
        transport = type(dist.group.WORLD.ferrodist_group.transport).__name__
        print(
            f"new_group + first all_reduce, {dist.get_world_size()} ranks (default group over {transport}), "
            f"median of {args.rounds} rounds"
        )
        print("| backend | time |")
        print("|---|---|")
        for backend, times in got.items():
            print(f"| {backend} | {statistics.median(times) * 1000:.1f} ms |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
