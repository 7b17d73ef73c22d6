"""torch.distributed over Gloo on CUDA (or CPU) tensors: the reference for the staged path.

    python bench/gpu/gloo_all_reduce.py [--sizes 4K,1M,64M] [--reps 10] [--device cuda]

Starts 2 processes itself (torch.multiprocessing), all_reduces float32 tensors of each size
on ``--device`` (both processes share GPU 0 unless the machine has two), and prints the
median per size as Markdown rows, like ``staged_all_reduce.py``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def worker(rank: int, size: int, port: int, args: Any, out: Any) -> None:
    import torch
    import torch.distributed as tdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=size)
    device = torch.device(args.device, rank % max(1, torch.cuda.device_count())) if args.device == "cuda" else "cpu"
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        tdist.all_reduce(x)  # warm-up
        times = []
        for _ in range(args.reps):
            tdist.barrier()
            if args.device == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            tdist.all_reduce(x)
            if args.device == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        if rank == 0:
            out.put((nbytes, statistics.median(times)))
    tdist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,1M,64M")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(worker, args=(2, port, args, out), nprocs=2, join=True, start_method="spawn")
    print(f"torch.distributed gloo all_reduce, float32, 2 processes, {args.device}")
    print("| size | gloo |")
    print("|---|---|")
    while not out.empty():
        nbytes, median = out.get()
        print(f"| {nbytes} B | {median * 1e3:.3f} ms |")


if __name__ == "__main__":
    main()
