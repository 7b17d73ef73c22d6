"""One configuration of the DDP step benchmark, run on every rank (bench/ddp/run.py starts it).

usage: ddp_step.py ENGINE BATCH STEPS [OPTIONS_JSON]
  ENGINE: single (one process, no DDP), ferrodist-shm, ferrodist-tcp, torch-gloo
Prints, on rank 0, one JSON line: the median step time and every step's time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

FEATURES, HIDDEN, CLASSES = 1024, 4096, 1024  # 25.2 M parameters (100.7 MB of float32 gradients)
#: untimed steps first: buffers, kernels, and DDP's overlap="auto" choice (10 steps)
WARMUP = 12


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def main() -> None:
    engine, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    torch.set_num_threads(1)  # one core per rank: the machine has two
    rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    net = model()
    finish = lambda: None  # noqa: E731
    if engine.startswith("ferrodist"):
        import ferrodist.collectives as dist
        from ferrodist.ddp import DDP, bf16_compress, fp16_compress

        dist.init_process_group(engine.split("-")[1], timeout=120)
        hook = {"fp16": fp16_compress, "bf16": bf16_compress, None: None}[options.pop("hook", None)]
        net = DDP(net, comm_hook=hook, **options)
        finish = dist.destroy_process_group
    elif engine == "torch-gloo":
        import torch.distributed as tdist
        from torch.nn.parallel import DistributedDataParallel

        tdist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_TORCH_PORT']}", rank=rank, world_size=size
        )
        net = DistributedDataParallel(net, **options)
        finish = tdist.destroy_process_group
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
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
    if rank == 0:
        print(json.dumps({"median": statistics.median(times), "times": times}), flush=True)
    finish()


if __name__ == "__main__":
    main()
