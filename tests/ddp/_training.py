"""The training runs the DDP tests compare: N ranks on shards against one process on the
whole batch. Shared by the in-process tests and the real-process script."""

from __future__ import annotations

from typing import Any

import numpy as np

from ferrodist import nn
from ferrodist.ddp import DistributedDataParallel

FEATURES, HIDDEN, CLASSES = 6, 16, 3


def make_model(dtype: Any = np.float64, seed: int = 0) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN, rng=seed, dtype=dtype),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN, rng=seed + 1, dtype=dtype),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES, rng=seed + 2, dtype=dtype),
    )


def make_batches(steps: int, batch: int, dtype: Any = np.float64, seed: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((batch, FEATURES)).astype(dtype), rng.integers(0, CLASSES, size=batch))
        for _ in range(steps)
    ]


def make_optimizer(name: str, params: Any) -> Any:
    if name == "sgd":
        return nn.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    if name == "adam":
        return nn.Adam(params, lr=0.01)
    raise ValueError(name)


def shard(x: np.ndarray, rank: int, size: int) -> np.ndarray:
    per = len(x) // size
    return x[rank * per : (rank + 1) * per]


def train_reference(optimizer: str, steps: int = 5, batch: int = 16, dtype: Any = np.float64) -> dict[str, np.ndarray]:
    """One process, the whole batch."""
    model = make_model(dtype)
    opt = make_optimizer(optimizer, model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    for x, y in make_batches(steps, batch, dtype):
        opt.zero_grad()
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
    return model.state_dict()


def train_ddp(
    group: Any,
    optimizer: str,
    steps: int = 5,
    batch: int = 16,
    dtype: Any = np.float64,
    **ddp_options: Any,
) -> dict[str, np.ndarray]:
    """Every rank: its shard of each batch, through DDP. Rank r starts from a model seeded
    differently (the first broadcast must make them equal)."""
    rank, size = group.rank, group.size
    model = DistributedDataParallel(make_model(dtype, seed=100 * rank), group, **ddp_options)
    opt = make_optimizer(optimizer, model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    for x, y in make_batches(steps, batch, dtype):
        opt.zero_grad()
        loss_fn(model(shard(x, rank, size)), shard(y, rank, size))
        model.backward(loss_fn.backward())
        opt.step()
    return model.state_dict()


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def reference_step(model: Any, opt: Any, shards: list[tuple[np.ndarray, np.ndarray]], divisor: int) -> None:
    """One process doing what DDP computes: the sum over the shards of each shard's mean-loss
    gradient, divided by ``divisor`` (the number of ranks averaged over), then a step."""
    loss_fn = nn.CrossEntropyLoss()
    opt.zero_grad(set_to_none=True)
    for x, y in shards:
        loss_fn(model(x), y)
        model.backward(loss_fn.backward() / divisor)
    opt.step()


def blobs(samples: int = 600, seed: int = 3, dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """A small classification task: CLASSES Gaussian clusters in FEATURES dimensions."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((CLASSES, FEATURES)) * 2.5
    y = rng.integers(0, CLASSES, size=samples)
    x = centres[y] + rng.standard_normal((samples, FEATURES))
    return x.astype(dtype), y


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(model(x), axis=1) == y))
