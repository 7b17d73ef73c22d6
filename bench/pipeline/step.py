"""Pipeline step time per schedule, on every rank of `ferrodist run -n P` (bench/pipeline/run.py).

An MLP of 8 linear layers of width 512 (ferrodist.nn, float32; numpy's matmul on one thread
per rank), cut into P stages (2 chunks per rank for the interleaved schedule), a batch of
256 rows in 8 micro-batches. The schedules run in rounds, interleaved; rank 0 prints one
JSON line: each schedule's step times, and the unsplit model's in one process.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

import ferrodist.collectives as dist
from ferrodist import nn
from ferrodist.pipeline import GPipe, Interleaved1F1B, OneFOneB, Pipeline, ZeroBubbleH1, split_sequential

WIDTH, LAYERS, BATCH, MICRO, STEPS, ROUNDS = 512, 8, 256, 8, 5, 3
SCHEDULES = {"GPipe": GPipe(), "1F1B": OneFOneB(), "Interleaved1F1B(2)": Interleaved1F1B(2), "ZB-H1": ZeroBubbleH1()}


def model() -> nn.Sequential:
    layers: list[nn.Module] = []
    for k in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH, rng=k, dtype=np.float32), nn.Tanh()]
    return nn.Sequential(*layers)


def main() -> None:
    world = dist.init_process_group(sys.argv[1] if len(sys.argv) > 1 else "auto", timeout=120)
    p, rank = world.size, world.rank
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    pipes = {}
    for name, schedule in SCHEDULES.items():
        stages = split_sequential(model(), p * schedule.chunks)
        pipes[name] = Pipeline([stages[c * p + rank] for c in range(schedule.chunks)], world, MICRO, schedule)
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    for _ in range(ROUNDS):
        for name, pipe in pipes.items():
            for step in range(STEPS + 1):
                world.barrier()
                start = time.perf_counter()
                pipe.train_step(x if rank == 0 else None, y if rank == p - 1 else None, nn.MSELoss())
                world.barrier()
                if step:  # the first step of a round warms up
                    times[name].append(time.perf_counter() - start)
                for module in pipe.modules:
                    module.zero_grad()
    if rank == 0:
        unsplit = model()
        single = []
        for step in range(STEPS + 1):
            start = time.perf_counter()
            loss_fn = nn.MSELoss()
            loss_fn(unsplit(x), y)
            unsplit.backward(loss_fn.backward())
            if step:
                single.append(time.perf_counter() - start)
            unsplit.zero_grad()
        print(json.dumps({"ranks": p, "schedules": times, "unsplit": single}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
