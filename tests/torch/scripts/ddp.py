"""torch's DistributedDataParallel over "ferrodist" against the same over "gloo", in one job
(run under torchrun: ``ddp.py STEPS``).

The default group is ferrodist's; a second group over the same ranks is Gloo's. Each
configuration builds two copies of one model (same seed), wraps one in DDP on each
group, and trains both for STEPS steps on the same per-rank batches. Prints, per rank and
configuration, ``ddp <config>: max |ferrodist - gloo| = X (bit-equal: B)``, and the
check of the training itself: ``ddp <config>: parameters agree across ranks``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ferrodist.torch  # noqa: F401  (registers the backend)


class Branchy(nn.Module):
    """A model one of whose branches is unused on odd steps when ``skip`` (for DDP's
    find_unused_parameters)."""

    def __init__(self, skip: bool) -> None:
        super().__init__()
        self.skip = skip
        self.body = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU())
        self.head = nn.Linear(48, 6)
        self.extra = nn.Linear(48, 6)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out = self.head(h)
        if not self.skip or self.step % 2 == 0:
            out = out + self.extra(h)
        return out


CONFIGS = {
    "default": {},
    "small-buckets": {"bucket_cap_mb": 0.001},
    "grad-views": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.005},
    "unused-params": {"find_unused_parameters": True},
    "fp16-hook": {"hook": default_hooks.fp16_compress_hook},
    "no-sync": {"no_sync_every": 2},
}


def train(group: dist.ProcessGroup, config: dict, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(1234)
    model = Branchy(skip=bool(config.get("find_unused_parameters")))
    options = {k: v for k, v in config.items() if k not in ("hook", "no_sync_every")}
    ddp = DDP(model, process_group=group, **options)
    if "hook" in config:
        ddp.register_comm_hook(group, config["hook"])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + dist.get_rank())
    every = config.get("no_sync_every", 0)
    for step in range(steps):
        model.step = step
        x = torch.randn(8, 24, generator=data)
        y = torch.randn(8, 6, generator=data)
        opt.zero_grad()
        if every and step % every == 0:
            with ddp.no_sync():  # accumulate locally; the next step's backward reduces both
                ((ddp(x) - y) ** 2).mean().backward()
            x = torch.randn(8, 24, generator=data)
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    dist.init_process_group("ferrodist")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    world = dist.group.WORLD
    for name, config in CONFIGS.items():
        ours = train(world, config, steps)
        theirs = train(gloo, config, steps)
        diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
        equal = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        print(f"rank {rank}: ddp {name}: max |ferrodist - gloo| = {diff:.3g} (bit-equal: {equal})", flush=True)
        # DDP's promise, checked on ferrodist's result alone: every rank holds the same parameters
        flat = torch.cat([p.reshape(-1) for p in ours])
        gathered = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(gathered, flat, group=gloo)
        if all(torch.equal(g, gathered[0]) for g in gathered):
            print(f"rank {rank}: ddp {name}: parameters agree across ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
