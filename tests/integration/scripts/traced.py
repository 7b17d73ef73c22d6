"""Run by tests/integration/test_trace.py as `ferrodist run -n 2 --trace DIR traced.py BACKEND`:
a little of everything a trace shows (collectives, messages, DDP, a pipeline), over one
backend."""

from __future__ import annotations

import sys
import time

import numpy as np

import ferrodist.collectives as dist
from ferrodist import nn
from ferrodist.ddp import DDP
from ferrodist.pipeline import OneFOneB, Pipeline, split_sequential


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16, rng=1), nn.ReLU(), nn.Linear(16, 4, rng=2))


def main() -> None:
    dist.init_process_group(sys.argv[1])
    rank = dist.get_rank()
    for step in range(3):
        if rank == 1 and step == 2:
            time.sleep(0.1)  # the others wait for rank 1 in the world's call #2
        dist.all_reduce(np.ones(1000, np.float32))
    dist.broadcast(np.zeros(10), 0)
    if rank == 0:
        dist.send(np.arange(4.0), 1)
    else:
        dist.recv(np.zeros(4), 0)
    ddp = DDP(model(), bucket_cap_mb=0.001)
    loss = nn.MSELoss()
    x = np.random.default_rng(rank).normal(size=(4, 8))
    out = ddp(x)
    loss(out, np.zeros_like(out))
    ddp.backward(loss.backward())
    stage = split_sequential(model(), 2)[rank]
    inputs = np.random.default_rng(0).normal(size=(8, 8)) if rank == 0 else None
    Pipeline(stage, None, 4, OneFOneB()).train_step(inputs, np.zeros((8, 4)), nn.MSELoss())
    print(f"rank {rank} traced over {dist.get_backend()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
