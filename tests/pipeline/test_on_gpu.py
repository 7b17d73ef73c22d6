"""Pipelines of PyTorch CUDA stages: activations and gradients received into CUDA tensors
and moved through the staged GPU engine. Needs a CUDA GPU and torch with CUDA (skipped
otherwise, with the reason); both ranks share the one GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from ferrodist.collectives import default_group

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
pytest.importorskip("ferrodist.pipeline", reason="ferrodist-pipeline is not installed (pip install packages/pipeline)")
from ferrodist.pipeline import OneFOneB, Pipeline, ZeroBubbleH1, split_sequential
from ferrodist.testing import run_world

sys.path.insert(0, str(Path(__file__).parent))
from _pipe import make_data
from test_torch_and_hybrid import (
    torch,  # skips this module without torch
    torch_model,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM=1: the CUDA simulator cannot run torch CUDA modules")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")


def cpu_reference(x, y):
    model = torch_model()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("schedule", [OneFOneB(), ZeroBubbleH1()], ids=repr)
@pytest.mark.parametrize("placement", ["both", "second"])
def test_cuda_stages_give_the_unsplit_gradients(schedule, placement):
    """Both stages on the GPU, or the first on the CPU and the second on the GPU."""
    from ferrodist.gpu import engine

    x, y = (torch.as_tensor(a) for a in make_data(9, seed=6))
    expected = cpu_reference(x, y)
    before = engine().stats.snapshot()

    def body():
        g = default_group()
        stage = split_sequential(torch_model(), 2)[g.rank]
        if placement == "both" or g.rank == 1:
            stage = stage.cuda()
        pipe = Pipeline(stage, None, 3, schedule)
        inputs = (x.cuda() if placement == "both" else x) if g.rank == 0 else None
        loss = pipe.train_step(inputs, y.cuda() if g.rank == 1 else None, torch.nn.CrossEntropyLoss())
        assert all(p.grad.device == next(stage.parameters()).device for p in stage.parameters())
        return loss, [p.grad.cpu().numpy().copy() for p in stage.parameters()]

    (_, first), (loss, second) = run_world(2, body)
    after = engine().stats.snapshot()
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(torch_model()(x), y)), abs=1e-10)
    got = first + second
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert np.max(np.abs(a - b)) <= 1e-9
    assert after[0] > before[0] and after[1] > before[1]  # the device engine moved the bytes


def test_cuda_eval_step_returns_a_cuda_tensor():
    x = torch.as_tensor(make_data(6)[0])
    with torch.no_grad():
        expected = torch_model()(x)

    def body():
        g = default_group()
        stage = split_sequential(torch_model(), 2)[g.rank].cuda()
        return Pipeline(stage, None, 2, OneFOneB()).eval_step(x.cuda() if g.rank == 0 else None)

    first, last = run_world(2, body)
    assert first is None and last.is_cuda
    assert torch.allclose(last.cpu(), expected, atol=1e-10, rtol=0)
