"""Device arrays through the pipeline's point-to-point path, on Numba's CUDA simulator.

A ``Stage`` subclass keeps its activations and gradients in Numba device arrays (the math
runs in ``ferrodist.nn`` on host copies: what is under test is the wire). The pipeline must
hand it device arrays, receive into device buffers the stage makes, and move them through
the group's device engine; the gradients must still equal the unsplit model's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from ferrodist.collectives import default_group
from ferrodist.core import CollectiveMismatch, GroupAborted, as_tensor

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
pytest.importorskip("ferrodist.pipeline", reason="ferrodist-pipeline is not installed (pip install packages/pipeline)")
from ferrodist.nn import CrossEntropyLoss
from ferrodist.pipeline import GPipe, Interleaved1F1B, OneFOneB, Pipeline, Stage, ZeroBubbleH1, split_sequential
from ferrodist.testing import run_world

sys.path.insert(0, str(Path(__file__).parent))
from _pipe import HIDDEN, make_data, make_model, reference_gradients, stage_names

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("these tests run on Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)", allow_module_level=True)
from numba import cuda

engine = pytest.importorskip("ferrodist.gpu", reason="the device engine is in ferrodist-gpu").engine


def on_device(array):
    assert as_tensor(array).is_cuda, type(array)
    return array


class DeviceStage(Stage):
    """A ``ferrodist.nn`` chunk whose inputs, outputs and gradients are device arrays."""

    def __init__(self, module, wrong_width=False):
        self.module = module
        self.saved, self.seeds = {}, {}
        self.wrong_width = wrong_width

    def forward(self, mb, x, *, keep):
        y = self.module(on_device(x).copy_to_host())
        stash = self.module.stash()
        if keep:
            self.saved[mb] = stash
        if self.wrong_width and mb == 1:
            y = y[:, :-1]
        return cuda.to_device(np.ascontiguousarray(y))

    def loss(self, mb, output, target, loss_fn, weight):
        value = float(loss_fn(on_device(output).copy_to_host(), target))
        self.seeds[mb] = cuda.to_device(np.asarray(loss_fn.backward()) * weight)
        return value * weight

    def backward_input(self, mb, grad):
        self.module.restore(self.saved.pop(mb))
        seed = self.seeds.pop(mb) if grad is None else grad
        gx = self.module.backward_input(on_device(seed).copy_to_host())
        self.saved[mb] = self.module.stash()
        return cuda.to_device(gx)

    def backward_weight(self, mb):
        self.module.restore(self.saved.pop(mb))
        self.module.backward_weight()

    def outgoing(self, value, dtype=None):
        if dtype is None or value.dtype == dtype.numpy:
            return on_device(value)
        return cuda.to_device(value.copy_to_host().astype(dtype.numpy))

    def empty(self, shape, dtype):
        return cuda.device_array(shape, dtype.numpy)

    def copy(self, value):
        return cuda.to_device(value.copy_to_host())

    def concat(self, parts):
        return cuda.to_device(np.concatenate([p.copy_to_host() for p in parts]))


def run_on_device(size, schedule, m, x, y, stage=DeviceStage):
    def body():
        g = default_group()
        total = size * schedule.chunks
        chunks = split_sequential(make_model(), total)
        mine = [chunks[c * size + g.rank] for c in range(schedule.chunks)]
        pipe = Pipeline([stage(c) for c in mine], None, m, schedule)
        loss = pipe.train_step(
            cuda.to_device(x) if g.rank == 0 else None, y if g.rank == size - 1 else None, CrossEntropyLoss()
        )
        names = stage_names(total)
        grads = {
            names[c * size + g.rank][n]: p.grad.copy() for c, s in enumerate(mine) for n, p in s.named_parameters()
        }
        return loss, grads

    return run_world(size, body)


@pytest.mark.parametrize(
    ("size", "schedule"),
    [(2, OneFOneB()), (2, ZeroBubbleH1()), (2, Interleaved1F1B(2)), (1, GPipe())],
    ids=["1f1b", "zb-h1", "interleaved", "one-rank"],
)
def test_device_activations_give_the_unsplit_gradients(size, schedule):
    x, y = make_data(7, seed=5)
    loss, expected = reference_gradients(x, y)
    before = engine().stats.snapshot()
    results = run_on_device(size, schedule, 3, x, y)
    after = engine().stats.snapshot()
    assert results[-1][0] == pytest.approx(float(loss), abs=1e-12)
    grads = {k: v for _, g in results for k, v in g.items()}
    assert grads.keys() == expected.keys()
    for name, want in expected.items():
        assert np.max(np.abs(grads[name] - want)) <= 1e-10, name
    # every boundary between ranks staged each activation once down and each gradient once up,
    # and nothing else: 7 rows of HIDDEN float64 per boundary and direction
    boundaries = size * schedule.chunks - 1 if size > 1 else 0
    moved = boundaries * 2 * 7 * HIDDEN * 8
    assert (after[0] - before[0], after[1] - before[1]) == (moved, moved)


def test_device_eval_step_returns_device_outputs():
    x, _ = make_data(6, seed=2)
    expected = make_model()(x)

    def body():
        g = default_group()
        stage = DeviceStage(split_sequential(make_model(), 2)[g.rank])
        out = Pipeline(stage, None, 2, OneFOneB()).eval_step(cuda.to_device(x) if g.rank == 0 else None)
        return None if out is None else on_device(out).copy_to_host()

    first, last = run_world(2, body)
    assert first is None
    np.testing.assert_allclose(last, expected, rtol=0, atol=1e-12)


def test_a_device_stage_that_changes_shape_fails_every_rank():
    x, y = make_data(8, seed=1)

    def body():
        g = default_group()
        stage = DeviceStage(split_sequential(make_model(), 2)[g.rank], wrong_width=g.rank == 0)
        pipe = Pipeline(stage, None, 4, OneFOneB())
        with pytest.raises((CollectiveMismatch, GroupAborted)) as caught:
            pipe.train_step(cuda.to_device(x) if g.rank == 0 else None, y if g.rank == 1 else None, CrossEntropyLoss())
        return type(caught.value).__name__, str(caught.value)

    (kind0, text0), (_, text1) = run_world(2, body, timeout=30)
    assert kind0 == "CollectiveMismatch" and "micro-batch 1" in text0 and f"(2, {HIDDEN})" in text0
    assert "rank 0" in text1


@pytest.mark.parametrize("device_rank", [0, 1])
def test_a_host_stage_and_a_device_stage_talk(device_rank):
    """One stage on the host (a plain ``ferrodist.nn`` module), one on the device: each
    receives into its own kind of buffer, the bytes are the same."""
    x, y = make_data(9, seed=4)
    loss, expected = reference_gradients(x, y)

    def body():
        g = default_group()
        chunk = split_sequential(make_model(), 2)[g.rank]
        stage = DeviceStage(chunk) if g.rank == device_rank else chunk
        inputs = (cuda.to_device(x) if device_rank == 0 else x) if g.rank == 0 else None
        got = Pipeline(stage, None, 3, ZeroBubbleH1()).train_step(
            inputs, y if g.rank == 1 else None, CrossEntropyLoss()
        )
        names = stage_names(2)[g.rank]
        return got, {names[n]: p.grad.copy() for n, p in chunk.named_parameters()}

    results = run_world(2, body)
    assert results[1][0] == pytest.approx(float(loss), abs=1e-12)
    grads = {**results[0][1], **results[1][1]}
    for name, want in expected.items():
        assert np.max(np.abs(grads[name] - want)) <= 1e-10, name
