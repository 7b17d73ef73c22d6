"""PyTorch stages through autograd (B: the input gradient, W: the weights), and the hybrid:
2 pipelines x 2 stages on 4 ranks with DDP across each stage's replicas."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ferrodist.collectives import default_group, new_group

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
pytest.importorskip("ferrodist.pipeline", reason="ferrodist-pipeline is not installed (pip install packages/pipeline)")
from ferrodist.pipeline import GPipe, Interleaved1F1B, OneFOneB, Pipeline, ZeroBubbleH1, split_sequential
from ferrodist.testing import run_world

sys.path.insert(0, str(Path(__file__).parent))
from _pipe import hybrid_training, make_data, reference_training

torch = pytest.importorskip("torch")
_SEEDING = threading.Lock()  # ranks are threads: torch's default generator is global


def torch_model():
    with _SEEDING, torch.random.fork_rng():
        torch.manual_seed(0)
        layers = []
        for width_in, width_out in [(5, 8), (8, 8), (8, 8), (8, 3)]:
            layers += [torch.nn.Linear(width_in, width_out), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers).double()


@pytest.mark.parametrize("schedule", [GPipe(), OneFOneB(), Interleaved1F1B(2), ZeroBubbleH1()], ids=repr)
@pytest.mark.parametrize("m", [1, 3, 4])
def test_torch_stages_give_the_unsplit_gradients(schedule, m):
    x, y = (torch.as_tensor(a) for a in make_data(7))
    ref = torch_model()
    loss = torch.nn.functional.cross_entropy(ref(x), y)
    loss.backward()
    expected = [p.grad.numpy().copy() for p in ref.parameters()]

    def body():
        g = default_group()
        stages = split_sequential(torch_model(), 2 * schedule.chunks)
        mine = [stages[c * 2 + g.rank] for c in range(schedule.chunks)]
        pipe = Pipeline(mine, None, m, schedule)
        got = pipe.train_step(x if g.rank == 0 else None, y if g.rank == 1 else None, torch.nn.CrossEntropyLoss())
        return got, {
            (c * 2 + g.rank, i): p.grad.numpy().copy() for c, s in enumerate(mine) for i, p in enumerate(s.parameters())
        }

    results = run_world(2, body)
    assert results[1][0] == pytest.approx(loss.item(), abs=1e-12) and results[0][0] is None
    grads = {**results[0][1], **results[1][1]}
    ordered = [grads[k] for k in sorted(grads)]
    assert len(ordered) == len(expected)
    for got, want in zip(ordered, expected, strict=True):
        assert np.max(np.abs(got - want)) <= 1e-10


def test_torch_eval_step():
    x, _ = make_data(6)
    x = torch.as_tensor(x)
    with torch.no_grad():
        expected = torch_model()(x)

    def body():
        g = default_group()
        stage = split_sequential(torch_model(), 2)[g.rank]
        return Pipeline(stage, None, 2, OneFOneB()).eval_step(x if g.rank == 0 else None)

    first, last = run_world(2, body)
    assert first is None and torch.allclose(last, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("schedule", [OneFOneB(), ZeroBubbleH1()], ids=repr)
def test_two_pipelines_by_two_stages_with_ddp_equal_one_process(schedule):
    x, y = make_data(12, seed=3)
    expected = reference_training(x, y, steps=3)

    def body():
        return hybrid_training(default_group(), new_group, x, y, 3, schedule, 3)

    seen = {}
    for state in run_world(4, body):
        for name, value in state.items():
            if name in seen:  # the two replicas of a stage stay equal
                assert np.array_equal(seen[name], value)
            seen[name] = value
    assert set(seen) == set(expected)
    assert max(float(np.max(np.abs(seen[k] - expected[k]))) for k in expected) <= 1e-10


@pytest.mark.parametrize("m", [1, 2])
def test_bfloat16_activations_cross_the_wire(m):
    """Activations and gradients in bfloat16 (the header carries the dtype): one
    micro-batch runs the unsplit model's exact operations; two agree to bfloat16's precision."""
    x, y = (torch.as_tensor(a) for a in make_data(8))
    x = x.bfloat16()
    ref = torch_model().bfloat16()
    torch.nn.functional.cross_entropy(ref(x).float(), y).backward()
    expected = [p.grad.float().numpy().copy() for p in ref.parameters()]

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.float(), target)

    def body():
        g = default_group()
        stage = split_sequential(torch_model().bfloat16(), 2)[g.rank]
        Pipeline(stage, None, m, GPipe()).train_step(x if g.rank == 0 else None, y if g.rank == 1 else None, loss_fn)
        return [p.grad.float().numpy().copy() for p in stage.parameters()]

    first, second = run_world(2, body)
    got = first + second
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        if m == 1:
            assert np.array_equal(a, b)
        else:
            assert np.max(np.abs(a - b)) <= 2e-2 * max(1.0, float(np.max(np.abs(b))))
