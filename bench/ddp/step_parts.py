"""Where a step of ferrodist's DDP goes: forward, backward (and, of it, the wait for the
buckets after autograd is done), the optimizer; the buckets and which live in shared memory.

    ferrodist run -n 2 bench/ddp/step_parts.py [--overlap on|off|auto] [--batch 8] [--steps 25]

The model and the optimizer are bench/ddp/run.py's (a 25.2 M-parameter MLP, SGD with
momentum, one thread per rank). Each rank prints the median of each part over the steps
after the first five, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ddp_step import CLASSES, FEATURES, model

import ferrodist.collectives as dist
from ferrodist.ddp import DDP


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overlap", choices=("on", "off", "auto"), default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("shm", timeout=120)
    overlap = {"on": True, "off": False, "auto": "auto"}[args.overlap]
    net = DDP(model(), overlap=overlap)
    waits: list[tuple[float, float]] = []
    net._reducer.on_step = lambda last_ready, ready, wait: waits.append((last_ready, wait))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(args.batch, FEATURES), torch.randint(0, CLASSES, (args.batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": [], "step": []}
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if step >= 5:
            for name, took in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                parts[name].append(took)
    reducer = net._reducer
    medians = {name: round(statistics.median(v) * 1e3, 1) for name, v in parts.items()}
    wait = round(statistics.median(w for _, w in waits[5:]) * 1e3, 1)
    buckets = [(len(b.params), b.numel, shared) for b, shared in zip(reducer.plan.buckets, reducer.shared, strict=True)]
    print(
        f"rank {dist.get_rank()}: {medians} ms; of backward, waiting for the buckets: {wait} ms; "
        f"buckets (parameters, elements, shared): {buckets}"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
