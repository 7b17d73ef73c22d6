"""Run by tests/torch/test_torchrun.py on every rank of a job over two nodes (one
``ferrodist run --nnodes 2`` per node): ``levels.py``.

torch's default group over the "ferrodist" backend must run over two levels (the launcher
says the ranks span nodes); every collective the levels run is checked on torch tensors
against the closed form, a float all_reduce must end with the same bits on every rank, and
a group made after it stays a subgroup over the same transport. Prints one line::

    rank 0: torch over two nodes, backend=levels, checks=23
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import ferrodist.torch  # noqa: F401  (registers the backend)
from ferrodist.collectives import get_backend


def main() -> None:
    dist.init_process_group("ferrodist", timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD.ferrodist_group
    checks = 0
    for count in (3, 5000, 300_001):  # the pairs path, the leaders, the shards
        base = torch.arange(count, dtype=torch.float32) % 97
        x = base + rank
        dist.all_reduce(x)
        assert torch.equal(x, size * base + size * (size - 1) // 2), "all_reduce"
        for root in (0, size - 1):
            y = base + rank
            dist.broadcast(y, src=root)
            assert torch.equal(y, base + root), "broadcast"
            z = base + rank
            dist.reduce(z, dst=root, op=dist.ReduceOp.MAX)
            assert torch.equal(z, base + (size - 1 if rank == root else rank)), "reduce"
        parts = [torch.zeros(count) for _ in range(size)]
        dist.all_gather(parts, torch.full((count,), float(rank)))
        assert all(torch.equal(p, torch.full((count,), float(r))) for r, p in enumerate(parts)), "all_gather"
        mine = torch.zeros(count)
        dist.reduce_scatter(mine, [torch.full((count,), float(r + rank)) for r in range(size)])
        assert torch.equal(mine, torch.full((count,), float(size * rank + size * (size - 1) // 2))), "reduce_scatter"
        dist.barrier()
        checks += 7
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(rank))
    dist.all_reduce(x)
    everyone = [torch.zeros_like(x) for _ in range(size)]
    dist.all_gather(everyone, x)
    assert all(torch.equal(x, other) for other in everyone), "the same bits on every rank"
    checks += 1
    sub = dist.new_group(list(range(size)))
    x = torch.ones(4)
    dist.all_reduce(x, group=sub)
    assert torch.equal(x, torch.full((4,), float(size))), "subgroup"
    assert sub.ferrodist_group.transport is world.transport, "the new group opened a transport of its own"
    checks += 1
    print(f"rank {rank}: torch over two nodes, backend={get_backend(world)}, checks={checks}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
