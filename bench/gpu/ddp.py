"""DDP of one CUDA model three ways in one job: ferrodist's own DDP, torch's DDP over the
"ferrodist" backend, and torch's DDP over Gloo.

    ferrodist run -n 2 bench/gpu/ddp.py [--device cuda|cpu] [--rounds 3] [--batch 8] [--steps 12] [--json PATH]
    torchrun --nproc-per-node 2 bench/gpu/ddp.py ...

The model is bench/ddp/ddp_step.py's MLP (1024 -> 4096 -> 4096 -> 1024: 25.2 M parameters,
100.7 MB of float32 gradients per step), SGD with momentum, cross-entropy, a small batch
(8 rows per rank by default): a communication-bound step. The job's default torch group
runs on backend "ferrodist" (``import ferrodist.torch`` registers it; shm on one host), a
Gloo group covers the same processes, and each configuration trains a fresh copy of the
model from the same seed on the same data:

- ``ferrodist.ddp.DDP`` over the ferrodist process group that the default torch group runs
  on (``dist.group.WORLD.ferrodist_group``);
- ``torch.nn.parallel.DistributedDataParallel`` over the default group ("ferrodist");
- ``torch.nn.parallel.DistributedDataParallel`` over the Gloo group.

Configurations run in rounds, interleaved, so that a busy moment of the machine hits all
of them; in each round a configuration's figure is the slowest rank's median step (a step
ends when every rank's does; CUDA is synchronised before and after each step). Rank 0
prints one Markdown table: each configuration's median over the rounds and its speed
relative to torch's DDP over Gloo (above 1: faster).

The three runs must have trained the same model: after every round each configuration's
parameters are compared with those of torch's DDP over Gloo, on every rank, and the largest
absolute difference is printed beside ``--tolerance`` (default 0: bit-equal, which two
ranks give, since halving and adding two float32 values rounds the same either way). A
difference above it fails the job (exit 1) after the table and the JSON are written.

``--device cpu`` runs the same on CPU tensors (``make test`` runs it with tiny sizes:
``--features 16 --hidden 32 --classes 8``). Ranks use GPU ``LOCAL_RANK % count``.
``--json PATH`` writes the rows and the parameter check (rank 0), for tools/gpu_summary.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ferrodist.torch  # noqa: F401  (registers "ferrodist")
from ferrodist.ddp import DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ddp"))
import ddp_step

#: The configuration the others are timed and checked against.
REFERENCE = "torch_ddp_gloo"


def model(features: int, hidden: int, classes: int) -> torch.nn.Module:
    """bench/ddp/ddp_step.py's MLP (seeded, so every configuration starts from the same
    parameters), with its three sizes set to these (its defaults: the 25.2 M-parameter one)."""
    ddp_step.FEATURES, ddp_step.HIDDEN, ddp_step.CLASSES = features, hidden, classes
    return ddp_step.model()


def device_of(kind: str) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK % count`` (made current) or the CPU."""
    if kind == "cpu":
        torch.set_num_threads(1)  # one core per rank, as bench/ddp's figures
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu/ddp.py: torch sees no CUDA GPU here; run with --device cpu, or on a GPU machine")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def train(
    wrap: Callable[[torch.nn.Module], Any], args: argparse.Namespace, device: torch.device
) -> tuple[float, list[torch.Tensor]]:
    """Train a fresh model wrapped by ``wrap`` for ``--warmup`` + ``--steps`` steps: the
    slowest rank's median step time (warm-up steps not counted) and the final parameters."""
    net = model(args.features, args.hidden, args.classes).to(device)
    wrapped = wrap(net)
    opt = torch.optim.SGD(wrapped.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch, args.features, generator=gen).to(device)
    y = torch.randint(0, args.classes, (args.batch,), generator=gen).to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)  # over the default group, outside the timing
    params = [p.detach().clone() for p in net.parameters()]
    del wrapped, opt, net
    return float(median.item()), params


def largest_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """The largest absolute difference between two models' parameters, over every rank."""
    local = max(float((a.double() - b.double()).abs().max().item()) for a, b in zip(ours, theirs, strict=True))
    found = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return float(found.item())


def count_of(numel: int) -> str:
    return f"{numel / 1e6:.1f} M" if numel >= 100_000 else f"{numel:,}"


def show(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="where the model trains (default cuda)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three configurations, interleaved")
    parser.add_argument("--batch", type=int, default=8, help="rows per rank and step (default 8)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=ddp_step.WARMUP, help="untimed steps before them")
    parser.add_argument("--features", type=int, default=ddp_step.FEATURES, help="the MLP's input width")
    parser.add_argument("--hidden", type=int, default=ddp_step.HIDDEN, help="the MLP's two hidden widths")
    parser.add_argument("--classes", type=int, default=ddp_step.CLASSES, help="the MLP's output width")
    parser.add_argument("--tolerance", type=float, default=0.0, help="largest parameter difference allowed (default 0)")
    parser.add_argument("--json", type=Path, help="write the rows and the parameter check here (rank 0)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit(
            "run me under a launcher: ferrodist run -n 2 bench/gpu/ddp.py (or torchrun --nproc-per-node 2)"
        )
    if min(args.rounds, args.steps, args.batch) < 1 or args.warmup < 0:
        raise SystemExit("bench/gpu/ddp.py: --rounds, --steps and --batch must be at least 1, --warmup at least 0")
    device = device_of(args.device)
    dist.init_process_group("ferrodist", timeout=timedelta(seconds=300))
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    world = dist.group.WORLD
    ours = world.ferrodist_group  # the ferrodist ProcessGroup the default torch group runs on
    transport = type(ours.transport).__name__.removesuffix("Transport").lower()
    configs: dict[str, tuple[str, Callable[[torch.nn.Module], Any]]] = {
        "ferrodist_ddp": (f"ferrodist.ddp.DDP, ferrodist group ({transport})", lambda net: DDP(net, ours)),
        "torch_ddp_ferrodist": (
            f'torch DDP over "ferrodist" ({transport})',
            lambda net: DistributedDataParallel(net, process_group=world),
        ),
        REFERENCE: (
            "torch DDP over Gloo",
            lambda net: DistributedDataParallel(net, process_group=gloo),
        ),
    }
    seconds: dict[str, list[float]] = {key: [] for key in configs}
    differences: dict[str, list[float]] = {key: [] for key in configs if key != REFERENCE}
    for r in range(args.rounds):
        params: dict[str, list[torch.Tensor]] = {}
        for key, (name, wrap) in configs.items():
            step, params[key] = train(wrap, args, device)
            seconds[key].append(step)
            if rank == 0:
                print(f"round {r + 1}: {name}: {show(step)} per step", file=sys.stderr, flush=True)
        for key in differences:
            differences[key].append(largest_difference(params[key], params[REFERENCE]))
        del params
    numel = sum(p.numel() for p in model(args.features, args.hidden, args.classes).parameters())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if device.type == "cuda":
        count = torch.cuda.device_count()
        where += ", one GPU per rank" if count >= size else f", {size} ranks sharing {count} GPU(s)"
    header = (
        f"DDP of a {count_of(numel)}-parameter MLP on {args.device} ({where}), {size} ranks, batch {args.batch} "
        f"per rank, {args.steps} steps after {args.warmup} warm-up; the slowest rank's median step, "
        f"median over {args.rounds} round(s)"
    )
    medians = {key: statistics.median(values) for key, values in seconds.items()}
    worst = {key: max(values) for key, values in differences.items()}
    passed = all(value <= args.tolerance for value in worst.values())
    if rank == 0:
        print(header)
        print("| configuration | step | vs torch DDP over Gloo |\n|---|---|---|")
        for key, (name, _) in configs.items():
            print(f"| {name} | {show(medians[key])} | {medians[REFERENCE] / medians[key]:.2f}x |")
        found = "; ".join(
            f"{configs[key][0]}: {'bit-equal' if value == 0 else f'{value:.3g}'}" for key, value in worst.items()
        )
        verdict = "the same model" if passed else "NOT the same model"
        print(
            f"parameters against torch DDP over Gloo, every round, every rank: {found} "
            f"(largest absolute difference allowed: {args.tolerance:g}): {verdict}",
            flush=True,
        )
        if args.json is not None:
            rows = [
                {
                    "key": key,
                    "configuration": name,
                    "median_s": medians[key],
                    "rounds_s": seconds[key],
                    "gloo_per_this": medians[REFERENCE] / medians[key],
                }
                for key, (name, _) in configs.items()
            ]
            check = {"tolerance": args.tolerance, "max_abs_difference": worst, "passed": passed}
            facts = {"header": header, "device": args.device, "ranks": size, "parameters": numel, "batch": args.batch}
            args.json.write_text(json.dumps({**facts, "rows": rows, "check": check}, indent=1) + "\n")
    dist.destroy_process_group()
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
