"""Train a classifier cut into pipeline stages: `ferrodist run -n 4 examples/train_pipeline.py`.

The spirals of examples/train_ddp.py, an eight-layer MLP cut into as many stages as there
are ranks (balanced by parameters), 8 micro-batches per batch, 1F1B by default. The last
stage prints the loss per epoch and the test accuracy; every rank then trains the unsplit
model in one process on the same batches and checks its stage against it.

Options: --epochs N, --batch B, --microbatches M, --backend tcp|shm,
--schedule gpipe|1f1b|interleaved|zb (interleaved cuts 2 chunks per rank).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

import ferrodist.collectives as dist
from ferrodist import nn
from ferrodist.pipeline import GPipe, Interleaved1F1B, OneFOneB, Pipeline, ZeroBubbleH1, simulate, split_sequential
from train_ddp import ARMS, TRAIN, spirals

SCHEDULES = {"gpipe": GPipe(), "1f1b": OneFOneB(), "interleaved": Interleaved1F1B(2), "zb": ZeroBubbleH1()}


def make_model() -> nn.Sequential:
    widths = [2, 64, 64, 64, ARMS]
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Linear(a, b, rng=k + 1), nn.Tanh()]
    return nn.Sequential(*layers[:-1])  # no activation after the last linear layer


def batches(n: int, batch: int, epoch: int) -> list[np.ndarray]:
    order = np.random.default_rng(100 + epoch).permutation(n)
    return [order[i : i + batch] for i in range(0, n, batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=60)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    args = parser.parse_args()
    world = dist.init_process_group(args.backend)
    p, rank = world.size, world.rank
    schedule = SCHEDULES[args.schedule]
    x, y = spirals()
    x_train, y_train, x_test, y_test = x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]
    total = p * schedule.chunks
    stages = split_sequential(make_model(), total)
    mine = [stages[c * p + rank] for c in range(schedule.chunks)]
    pipe = Pipeline(mine, world, args.microbatches, schedule)
    opt = nn.SGD([q for s in mine for q in s.parameters()], lr=0.1, momentum=0.9)
    first, last = rank == 0, rank == p - 1
    if last:
        timeline = simulate(schedule, p, args.microbatches)
        print(f"{schedule!r} on {p} ranks, {args.microbatches} micro-batches: bubble {timeline.bubble_fraction:.1%}")
    for epoch in range(args.epochs):
        losses = []
        for rows in batches(TRAIN, args.batch, epoch):
            opt.zero_grad()
            loss = pipe.train_step(
                x_train[rows] if first else None, y_train[rows] if last else None, nn.CrossEntropyLoss()
            )
            opt.step()
            losses.append(loss)
        if last:
            print(f"epoch {epoch + 1:2d}: loss {np.mean(losses):.4f}", flush=True)
    out = pipe.eval_step(x_test if first else None)
    if last:
        print(f"test accuracy: {np.mean(out.argmax(axis=1) == y_test):.3f}")

    # The same training in one process, unsplit; this rank compares its stages with it.
    model = make_model()
    ref_opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.epochs):
        for rows in batches(TRAIN, args.batch, epoch):
            ref_opt.zero_grad()
            loss_fn = nn.CrossEntropyLoss()
            loss_fn(model(x_train[rows]), y_train[rows])
            model.backward(loss_fn.backward())
            ref_opt.step()
    reference = split_sequential(model, total)
    worst = np.zeros(1)
    for c, stage in enumerate(mine):
        pairs = zip(stage.parameters(), reference[c * p + rank].parameters(), strict=True)
        worst[0] = max([worst[0], *(float(np.max(np.abs(a.data - b.data))) for a, b in pairs)])
    world.all_reduce(worst, "max")
    if last:
        verdict = "equal" if worst[0] <= 1e-9 else "DIFFERENT"
        print(f"check: the {p}-stage model vs one process, unsplit: max difference {worst[0]:.1e} ({verdict})")
    dist.destroy_process_group()
    if worst[0] > 1e-9:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
