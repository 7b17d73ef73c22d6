"""What the pipeline tests share: a model, data, the unsplit reference, a pipelined run."""

from __future__ import annotations

import numpy as np

from ferrodist.nn import SGD, CrossEntropyLoss, Linear, Sequential, Tanh
from ferrodist.pipeline import Pipeline, split_sequential

FEATURES, HIDDEN, CLASSES = 5, 8, 3


def make_model():
    """Eight layers (four linear), float64, the same weights every time."""
    return Sequential(
        Linear(FEATURES, HIDDEN, rng=1),
        Tanh(),
        Linear(HIDDEN, HIDDEN, rng=2),
        Tanh(),
        Linear(HIDDEN, HIDDEN, rng=3),
        Tanh(),
        Linear(HIDDEN, CLASSES, rng=4),
        Tanh(),
    )


def make_data(rows, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, FEATURES)), rng.integers(0, CLASSES, rows)


def reference_gradients(x, y):
    """Loss and every parameter's gradient of the unsplit model on the whole batch."""
    model = make_model()
    loss_fn = CrossEntropyLoss()
    loss = loss_fn(model(x), y)
    model.backward(loss_fn.backward())
    return loss, {name: p.grad.copy() for name, p in model.named_parameters()}


def stage_names(n_stages):
    """Stage index -> {the stage's parameter name: the unsplit model's name}."""
    model = make_model()
    names = {id(p): name for name, p in model.named_parameters()}
    return [{name: names[id(p)] for name, p in stage.named_parameters()} for stage in split_sequential(model, n_stages)]


def pipelined_gradients(group, schedule, n_microbatches, x, y):
    """Run one train_step; returns (loss on this rank, {unsplit name: gradient})."""
    p, rank = group.size, group.rank
    total = p * schedule.chunks
    stages = split_sequential(make_model(), total)
    mine = [stages[c * p + rank] for c in range(schedule.chunks)]
    pipe = Pipeline(mine, group, n_microbatches, schedule)
    loss = pipe.train_step(
        x if rank == 0 else None, y if rank == p - 1 else None, CrossEntropyLoss(), broadcast_loss=True
    )
    names = stage_names(total)
    grads = {}
    for c, stage in enumerate(mine):
        for name, param in stage.named_parameters():
            grads[names[c * p + rank][name]] = param.grad.copy()
    return loss, grads


def reference_training(x, y, steps, lr=0.1):
    model = make_model()
    opt = SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn = CrossEntropyLoss()
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
    return {name: p.data.copy() for name, p in model.named_parameters()}


def hybrid_training(world, new_group, x, y, steps, schedule, n_microbatches, lr=0.1):
    """2 pipelines x 2 stages on 4 ranks: ranks 0-1 and 2-3 are pipelines, each on half
    the batch; DDP averages each stage across its two replicas. Returns {unsplit name: value}
    for this rank's stage."""
    from ferrodist.ddp import DDP

    rank = world.rank
    pipes = [new_group([0, 1]), new_group([2, 3])]
    replicas = [new_group([0, 2]), new_group([1, 3])]
    line, stage_index = divmod(rank, 2)
    stage = split_sequential(make_model(), 2)[stage_index]
    ddp = DDP(stage, group=replicas[stage_index], bucket_cap_mb=0.0005)
    pipe = Pipeline(stage, pipes[line], n_microbatches, schedule)
    opt = SGD(stage.parameters(), lr=lr, momentum=0.9)
    half = len(x) // 2
    xs, ys = x[line * half : (line + 1) * half], y[line * half : (line + 1) * half]
    for _ in range(steps):
        opt.zero_grad()
        pipe.train_step(xs if stage_index == 0 else None, ys if stage_index == 1 else None, CrossEntropyLoss())
        ddp.sync_gradients()
        opt.step()
    names = stage_names(2)[stage_index]
    return {names[name]: p.data.copy() for name, p in stage.named_parameters()}
