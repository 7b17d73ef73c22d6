"""torch's own DistributedDataParallel over the "ferrodist" backend against the same over
"gloo": same model, same data, one job.

    torchrun --nproc-per-node 2 bench/torch/ddp_backends.py [--rounds 3] [--batch 8] [--steps 12] [--json out.json]

A 25.2 M-parameter MLP (float32: 100.7 MB of gradients per step), SGD with momentum, one
thread per rank (``torch.set_num_threads(1)``), a small batch (8 rows per rank by
default): a communication-bound step. The job's default group is ferrodist's (shm on one
host); a Gloo group, a ferrodist group over tcp (``FERRODIST_TORCH_TRANSPORT=tcp`` when it
is made) and a group of one rank per rank (DDP without any communication) cover the same
processes, and each configuration wraps a fresh copy of the model in
``DistributedDataParallel(process_group=...)``, with torch's default options or with
``gradient_as_bucket_view=True`` (no copy of the averaged gradients out of the buckets).

Configurations run in rounds, interleaved, so that a busy moment of the machine hits all of
them; in each round a configuration's figure is the slowest rank's median step. Rank 0
prints one table: each configuration's median over the rounds, and its speed relative to
DDP over Gloo with the same DDP options in the same run (above 1: faster). Two rows bound
what a backend can do: "no DDP" is the step without DDP, and "DDP, no communication" is
torch's DDP (its bucket copies and division) on a group of one rank: a backend whose
all_reduce took no time would reach it. Below the table: one all_reduce of the whole
gradient's size on each backend, alone (the slowest rank's median of 5 per round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ferrodist.torch  # noqa: F401  (registers "ferrodist")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ddp"))
from ddp_step import CLASSES, FEATURES, WARMUP, model


def median_step(group: Any, options: dict[str, Any], batch: int, steps: int) -> float:
    """The median step time of DDP on ``group`` with ``options`` (``group=None``: no DDP),
    agreed across ranks (the slowest rank's median: a step ends when every rank's does)."""
    net = model()
    if group is not None:
        net = DistributedDataParallel(net, process_group=group, **options)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (batch,), generator=gen)
    times = []
    for i in range(WARMUP + steps):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)  # over the default group, outside the timing
    del net, opt
    return float(median.item())


def all_reduce_time(group: Any, numel: int, repeats: int = 5) -> float:
    """The median time of one all_reduce of ``numel`` float32 on ``group`` (the slowest rank's)."""
    x = torch.ones(numel)
    times = []
    for _ in range(repeats + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank and step (default 8)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per configuration and round")
    parser.add_argument("--json", type=Path, help="write every round's figures here (rank 0)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run me under torchrun: torchrun --nproc-per-node 2 bench/torch/ddp_backends.py")
    torch.set_num_threads(1)  # one core per rank: communication-bound, as on the machine these figures come from
    dist.init_process_group("ferrodist", timeout=timedelta(seconds=300))
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    os.environ["FERRODIST_TORCH_TRANSPORT"] = "tcp"
    tcp = dist.new_group(backend="ferrodist")
    del os.environ["FERRODIST_TORCH_TRANSPORT"]
    solo = [dist.new_group([r], backend="ferrodist") for r in range(size)][rank]  # every rank makes every group
    world = dist.group.WORLD
    shm = type(world.ferrodist_group.transport).__name__.removesuffix("Transport").lower()
    view = {"gradient_as_bucket_view": True}
    # name: (group, DDP options, the Gloo configuration it is compared with)
    configs: dict[str, tuple[Any, dict[str, Any], str]] = {
        "no DDP (each rank alone)": (None, {}, "DDP over gloo"),
        "DDP, no communication (a group of one rank)": (solo, {}, "DDP over gloo"),
        "DDP over gloo": (gloo, {}, "DDP over gloo"),
        f"DDP over ferrodist ({shm})": (world, {}, "DDP over gloo"),
        "DDP over ferrodist (tcp)": (tcp, {}, "DDP over gloo"),
        "DDP over gloo, gradient_as_bucket_view": (gloo, view, "DDP over gloo, gradient_as_bucket_view"),
        f"DDP over ferrodist ({shm}), gradient_as_bucket_view": (world, view, "DDP over gloo, gradient_as_bucket_view"),
    }
    results: dict[str, list[float]] = {name: [] for name in configs}
    numel = sum(p.numel() for p in model().parameters())
    alone = {f"ferrodist ({shm})": world, "ferrodist (tcp)": tcp, "gloo": gloo}
    all_reduces: dict[str, list[float]] = {name: [] for name in alone}
    for r in range(args.rounds):
        for name, group in alone.items():
            all_reduces[name].append(all_reduce_time(group, numel))
        for name, (group, options, _) in configs.items():
            seconds = median_step(group, options, args.batch, args.steps)
            results[name].append(seconds)
            if rank == 0:
                print(f"round {r + 1}: {name}: {seconds * 1e3:.1f} ms per step", file=sys.stderr, flush=True)
    if rank == 0:
        medians = {name: statistics.median(values) for name, values in results.items()}
        print(f"\n{size} ranks, batch {args.batch} per rank, {args.steps} steps, median step over {args.rounds} rounds")
        print("| configuration | step | vs DDP over gloo, same options |\n|---|---|---|")
        for name, (_, _, baseline) in configs.items():
            print(f"| {name} | {medians[name] * 1e3:.1f} ms | {medians[baseline] / medians[name]:.2f}x |")
        mb = numel * 4 / 1e6
        figures = ", ".join(f"{name} {statistics.median(v) * 1e3:.1f} ms" for name, v in all_reduces.items())
        print(f"\none all_reduce of the {mb:.1f} MB of gradients, alone: {figures}")
        if args.json:
            args.json.write_text(json.dumps({"steps": results, "all_reduce": all_reduces}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
