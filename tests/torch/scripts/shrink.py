"""Run by tests/torch/test_shrink.py on 3 ranks started by hand (env://): torch's
``shrink_group`` (``ferrodist.torch.shrink_group``) over the "ferrodist" backend on CPU tensors.

    shrink.py MODE OUTDIR

MODE kill:     rank 2 kills itself (SIGKILL) before the 4th all_reduce; the others' call fails,
               they call ``shrink_group()`` (the live ranks agree), and go on: all_reduce on the new default
               group, then torch DDP built over it for 3 steps.
MODE exclude:  rank 2 leaves without a word (it calls nothing more); the others call
               ``shrink_group([2])`` and go on as above.
Each survivor writes OUTDIR/rank{R}.json: the new world's size and rank, the all_reduce
results, and whether DDP's parameters are equal on both.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ferrodist.torch


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("ferrodist", timeout=__import__("datetime").timedelta(seconds=10))
    rank = dist.get_rank()
    result: dict[str, object] = {"rank": rank}
    for step in range(4):
        if step == 3 and rank == 2:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            return  # exclude: gone without a word (its transport stays open until exit)
        t = torch.full((8,), float(rank + 1 + 10 * step))
        if step < 3:
            dist.all_reduce(t)
            continue
        if mode == "kill":
            try:
                dist.all_reduce(t)
            except Exception as exc:  # the killed rank's loss
                result["failure"] = type(exc).__name__
    ferrodist.torch.shrink_group([2] if mode == "exclude" else None)
    result["size"], result["new_rank"] = dist.get_world_size(), dist.get_rank()
    t = torch.full((4,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(t)
    result["sum"] = t.tolist()
    pair = dist.new_group([1, 0])  # torch's renumbered ranks: a subgroup of the shrunk world's transport
    u = torch.tensor([float(dist.get_rank() + 5)])
    dist.all_reduce(u, group=pair)
    world = dist.group.WORLD
    result["pair"] = [u.item(), pair.ferrodist_group.transport is world.ferrodist_group.transport]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        loss = model(torch.randn(5, 6)).pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    result["ddp_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)
    (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
