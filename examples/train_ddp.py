"""Train a classifier with DistributedDataParallel: `ferrodist run -n 2 examples/train_ddp.py`
(make demo does).

The data set is generated here, the same on every rank and every run: three interleaved,
noisy spiral arms in the plane (1800 points, 1500 for training), which a straight line cannot
separate. Each rank takes its shard of every batch; DDP averages the gradients while
backward runs. Rank 0 shows a progress bar, the loss per epoch, the test accuracy and the
straggler summary, then trains the same model in one process on the whole batches and
checks that the N-rank model equals it.

Options: --epochs N, --batch B (the global batch; a multiple of the rank count),
--backend tcp|shm, --hook none|fp16|bf16|powersgd.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import ferrodist.collectives as dist
from ferrodist import nn
from ferrodist.ddp import DDP, bf16_compress, fp16_compress, powersgd

ARMS, PER_ARM, TRAIN = 3, 600, 1500


def spirals(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """ARMS spiral arms of PER_ARM noisy points each, shuffled with a fixed seed."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0.15, 1.0, PER_ARM)
    xs, ys = [], []
    for arm in range(ARMS):
        angle = 5.0 * t + 2 * np.pi * arm / ARMS + rng.normal(0, 0.4, PER_ARM)
        xs.append(np.stack([t * np.cos(angle), t * np.sin(angle)], axis=1))
        ys.append(np.full(PER_ARM, arm))
    x, y = np.concatenate(xs), np.concatenate(ys)
    order = rng.permutation(len(x))
    return x[order], y[order]


def make_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(2, 64, rng=1), nn.Tanh(), nn.Linear(64, 64, rng=2), nn.ReLU(), nn.Linear(64, ARMS, rng=3)
    )


def train(model, x, y, *, epochs, batch, rank, size, bar=None, on_epoch=None) -> None:
    """The training loop; ``model`` is a DDP model (``size`` ranks) or a plain one (size 1)."""
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    per = batch // size
    for epoch in range(epochs):
        losses = []
        for start in range(0, len(x) - batch + 1, batch):
            xb = x[start + rank * per : start + (rank + 1) * per]
            yb = y[start + rank * per : start + (rank + 1) * per]
            opt.zero_grad()
            losses.append(loss_fn(model(xb), yb))
            model.backward(loss_fn.backward())
            opt.step()
            if bar is not None:
                bar.update(1)
        if on_epoch is not None:
            on_epoch(epoch, float(np.mean(losses)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=60)
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--hook", default="none", choices=["none", "fp16", "bf16", "powersgd"])
    args = parser.parse_args()
    group = dist.init_process_group(args.backend, timeout=60)
    rank, size = group.rank, group.size
    if args.batch % size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {size} ranks")
    hooks = {"none": None, "fp16": fp16_compress, "bf16": bf16_compress, "powersgd": powersgd(rank=2)}
    x, y = spirals()
    x_train, y_train, x_test, y_test = x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]
    model = DDP(make_model(), comm_hook=hooks[args.hook])
    steps = args.epochs * (TRAIN // args.batch)

    bar = None
    if rank == 0:
        print(f"{size} ranks over {args.backend}, hook {args.hook}; buckets:\n{model.bucket_plan.describe()}")
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="training", unit="step", file=sys.stdout, mininterval=0.5)

    def on_epoch(epoch: int, loss: float) -> None:
        if bar is not None:
            bar.write(f"epoch {epoch + 1:2d}: loss {loss:.4f} (this rank's shards)")

    train(
        model, x_train, y_train, epochs=args.epochs, batch=args.batch, rank=rank, size=size, bar=bar, on_epoch=on_epoch
    )
    report = model.stats()  # every rank: the timings are exchanged
    if bar is not None:
        bar.close()
    status = 0
    if rank == 0:
        acc = np.mean(np.argmax(model.module(x_test), axis=1) == y_test)
        print(f"test accuracy: {acc:.3f} on {len(x_test)} held-out points")
        print(report.summary())
        if args.hook == "none":
            single = make_model()
            train(single, x_train, y_train, epochs=args.epochs, batch=args.batch, rank=0, size=1)
            state, ref = model.state_dict(), single.state_dict()
            diff = max(float(np.max(np.abs(state[k] - ref[k]))) for k in state)
            same = diff <= 1e-10
            print(
                f"{size}-rank model vs 1-rank model on the whole batches: max |difference| {diff:.2e} "
                f"({'equal within 1e-10' if same else 'DIFFERENT'})"
            )
            status = 0 if same else 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
