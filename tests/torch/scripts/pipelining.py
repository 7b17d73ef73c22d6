"""torch.distributed.pipelining over "ferrodist": a model cut in stages over 2 ranks,
trained with torch's GPipe, 1F1B and interleaved 1F1B schedules, against the same model
trained in one process (run under torchrun with 2 ranks: ``pipelining.py STEPS``).

For GPipe and 1F1B, rank 0 holds the first half of an MLP, rank 1 the second half and the
loss; for interleaved 1F1B the MLP is cut in four stages and rank r holds stages r and
r + 2 (so activations go 0 -> 1 -> 0 -> 1 and back). Each step feeds a batch of 16 rows in 4 micro-batches; torch's schedules send activations forward
and their gradients backward (``batch_isend_irecv`` through the backend), first to learn
each stage's shapes (metadata sent as objects), then every micro-batch. The reference
trains an identical model (same seed) in this process: for each micro-batch, the loss's
backward; the gradients divided by the number of micro-batches, as the schedules scale
them. Prints, per rank and schedule::

    rank R: pipelining <schedule>: max |pipeline - one process| = X over S steps (losses Y)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import ferrodist.torch  # noqa: F401  (registers the backend)

FEATURES, HIDDEN, CLASSES = 12, 32, 5
BATCH, MICROBATCHES = 16, 4
#: schedule name: (schedule class, the modules of each stage as slices of the model)
SCHEDULES = {
    "GPipe": (ScheduleGPipe, (slice(0, 4), slice(4, 7))),
    "1F1B": (Schedule1F1B, (slice(0, 4), slice(4, 7))),
    "interleaved-1F1B": (ScheduleInterleaved1F1B, (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7))),
}


def whole_model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, CLASSES),
    )


def stages_of(model: nn.Sequential, cuts: tuple[slice, ...], rank: int, size: int) -> list[nn.Sequential]:
    """The stages rank ``rank`` holds: ``rank``, ``rank + size``, ..."""
    return [model[cut] for cut in cuts[rank::size]]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches on every rank."""
    data = torch.Generator().manual_seed(99)
    return [
        (torch.randn(BATCH, FEATURES, generator=data), torch.randint(0, CLASSES, (BATCH,), generator=data))
        for _ in range(steps)
    ]


def one_process(steps: int) -> tuple[nn.Sequential, list[float]]:
    """The reference: the whole model, micro-batch by micro-batch, in this process."""
    model = whole_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        step_losses = []
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            loss = loss_fn(model(xm), ym)
            loss.backward()
            step_losses.append(loss.item())
        for p in model.parameters():
            assert p.grad is not None
            p.grad /= MICROBATCHES
        opt.step()
        losses.append(sum(step_losses) / MICROBATCHES)
    return model, losses


def pipelined(schedule_class: type, cuts: tuple[slice, ...], steps: int) -> tuple[list[nn.Module], list[float]]:
    """This rank's stages after ``steps`` steps of ``schedule_class``, and (on the rank of
    the last stage) each step's mean micro-batch loss."""
    rank, size = dist.get_rank(), dist.get_world_size()
    modules = stages_of(whole_model(), cuts, rank, size)
    stages = [
        PipelineStage(module, index, len(cuts), torch.device("cpu"))
        for module, index in zip(modules, range(rank, len(cuts), size), strict=True)
    ]
    if len(stages) == 1:
        schedule = schedule_class(stages[0], MICROBATCHES, loss_fn=loss_fn)
    else:
        schedule = schedule_class(stages, MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=step_losses)
            losses.append(sum(loss.item() for loss in step_losses) / MICROBATCHES)
        opt.step()
    return modules, losses


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    dist.init_process_group("ferrodist")
    rank = dist.get_rank()
    assert dist.get_world_size() == 2, "run with --nproc-per-node 2"
    reference, reference_losses = one_process(steps)
    for name, (schedule_class, cuts) in SCHEDULES.items():
        modules, losses = pipelined(schedule_class, cuts, steps)
        mine = stages_of(reference, cuts, rank, dist.get_world_size())
        ours = [p for m in modules for p in m.parameters()]
        theirs = [p for m in mine for p in m.parameters()]
        diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
        if losses:
            loss_diff = max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True))
            what = f"losses {losses[0]:.4f} .. {losses[-1]:.4f}, max |diff| {loss_diff:.3g}"
        else:
            what = "losses on rank 1"
        print(
            f"rank {rank}: pipelining {name}: max |pipeline - one process| = {diff:.3g} over {steps} steps ({what})",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
