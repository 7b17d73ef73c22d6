"""A small all_reduce through each way a torch user can call it, timed in one job.

    ferrodist run -n 2 bench/torch/small_call.py [--bytes 4096] [--dtype float32] [--calls 5000]

The default torch group has backend "ferrodist"; on it, rank 0 prints the time of one call
of: ferrodist's own API on a numpy array (``ferrodist.collectives.all_reduce`` on the
group under the torch group), the same on a torch CPU tensor, ``torch.distributed.all_reduce``
on the ferrodist group (blocking; with ``async_op=True`` and ``wait()``; and through its
future), and the same on a Gloo group of the same ranks, with each one's ratio to the
first; and what ``torch.distributed.all_reduce`` costs around a backend that does nothing
(the group's method replaced by one that returns a finished work), which every backend
written in Python pays. Every way runs ``--passes`` times, in turn; each keeps its fastest
pass (the others' noise on a shared machine only ever adds).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

import ferrodist.collectives as fd
import ferrodist.torch  # noqa: F401  (registers the backend)
from ferrodist.core import dtype as ferrodist_dtype
from ferrodist.torch import FerrodistProcessGroup, FerrodistWork


def per_call_us(run: Callable[[], object], calls: int, barrier: Callable[[], object]) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls * 1e6


def _with(group: FerrodistProcessGroup, allreduce: Callable[..., object], tensor: torch.Tensor) -> None:
    """``torch.distributed.all_reduce`` with ``group.allreduce`` replaced: what torch's
    function costs around the backend's method."""
    group.allreduce = allreduce
    try:
        dist.all_reduce(tensor)
    finally:
        del group.allreduce


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("ferrodist")
    pg = dist.distributed_c10d._get_default_group()
    ours = pg._get_backend(torch.device("cpu")) if not isinstance(pg, FerrodistProcessGroup) else pg
    group = ours.ferrodist_group
    gloo = dist.new_group(backend="gloo")
    dt = ferrodist_dtype(args.dtype)
    count = args.bytes // dt.itemsize
    array = np.ones(count, dt.numpy)
    tensor = torch.ones(count, dtype=getattr(torch, args.dtype))
    other = torch.ones(count, dtype=getattr(torch, args.dtype))
    ways = {
        "ferrodist API, numpy": lambda: fd.all_reduce(array, group=group),
        "ferrodist API, torch tensor": lambda: fd.all_reduce(tensor, group=group),
        'torch.distributed, "ferrodist"': lambda: dist.all_reduce(tensor),
        'torch.distributed, "ferrodist", async_op and wait': lambda: dist.all_reduce(tensor, async_op=True).wait(),
        'torch.distributed, "ferrodist", async_op and its future': lambda: (
            dist.all_reduce(tensor, async_op=True).get_future().wait()
        ),
        "torch.distributed, Gloo": lambda: dist.all_reduce(other, group=gloo),
    }
    done = FerrodistWork.done("allreduce on no group", [tensor])
    nothing = lambda tensors, opts=None, timeout=None: done  # noqa: E731
    ways["torch.distributed's own share (a backend that does nothing)"] = lambda: _with(ours, nothing, tensor)
    calls = {name: args.calls if "Gloo" not in name else max(args.calls // 50, 20) for name in ways}
    for name, run in ways.items():  # kernels compiled, buffers touched, connections made
        for _ in range(min(calls[name], 500)):
            run()
    from ferrodist.core.kernels import wait_for_compiles

    wait_for_compiles(600)
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(args.passes):
        for name, run in ways.items():
            best[name] = min(best[name], per_call_us(run, calls[name], dist.barrier))
    if dist.get_rank() == 0:
        first = best["ferrodist API, numpy"]
        print(
            f"all_reduce of {args.bytes} bytes of {args.dtype}, {dist.get_world_size()} ranks over "
            f"{type(group.transport).__name__}, fastest of {args.passes} passes:"
        )
        print("| way | time of a call | x ferrodist's API on numpy |")
        print("|---|---|---|")
        for name, took in best.items():
            print(f"| {name} | {took:.2f} us | {took / first:.2f}x |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
