"""Every backward against central finite differences in float64: input and parameter gradients."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import examples

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
from ferrodist.nn import CrossEntropyLoss, Linear, Module, MSELoss, ReLU, Sequential, Tanh

EPS = 1e-6
RTOL = 1e-6
ATOL = 1e-8


def numeric_grad(f, x: np.ndarray) -> np.ndarray:
    """d f() / d x by central differences, perturbing ``x`` in place (and putting it back)."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        old = x[index]
        x[index] = old + EPS
        plus = f()
        x[index] = old - EPS
        minus = f()
        x[index] = old
        grad[index] = (plus - minus) / (2 * EPS)
    return grad


def away_from_zero(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal samples pushed at least 0.1 from 0 (ReLU's kink is not differentiable)."""
    x = rng.normal(size=shape)
    return x + 0.1 * np.sign(x)


def check_module(module: Module, x: np.ndarray, rng: np.random.Generator) -> None:
    """Analytic gradients of ``sum(w * module(x))`` against finite differences."""
    w = rng.normal(size=module(x).shape)
    grad_input = module.backward(w)

    def objective() -> float:
        return float(np.sum(w * module(x)))

    np.testing.assert_allclose(grad_input, numeric_grad(objective, x), rtol=RTOL, atol=ATOL)
    for name, param in module.named_parameters():
        assert param.grad is not None, name
        np.testing.assert_allclose(param.grad, numeric_grad(objective, param.data), rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    rng = np.random.default_rng(0)
    layer = Linear(4, 3, bias=bias, rng=1)
    check_module(layer, rng.normal(size=(5, 4)), rng)
    assert [name for name, _ in layer.named_parameters()] == (["weight", "bias"] if bias else ["weight"])


@settings(max_examples=examples(25))
@given(
    batch=st.integers(1, 4),
    fan_in=st.integers(1, 4),
    fan_out=st.integers(1, 4),
    bias=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_linear_any_shape(batch, fan_in, fan_out, bias, seed):
    rng = np.random.default_rng(seed)
    check_module(Linear(fan_in, fan_out, bias=bias, rng=rng), rng.normal(size=(batch, fan_in)), rng)


def test_relu():
    rng = np.random.default_rng(2)
    check_module(ReLU(), away_from_zero(rng, (4, 6)), rng)


def test_relu_gradient_is_zero_at_zero():
    relu = ReLU()
    relu(np.array([[-1.0, 0.0, 2.0]]))
    np.testing.assert_array_equal(relu.backward(np.ones((1, 3))), [[0.0, 0.0, 1.0]])


def test_tanh():
    rng = np.random.default_rng(3)
    check_module(Tanh(), rng.normal(size=(3, 5)), rng)


def test_sequential():
    rng = np.random.default_rng(4)
    model = Sequential(Linear(3, 6, rng=rng), Tanh(), Linear(6, 5, rng=rng), ReLU(), Linear(5, 2, rng=rng))
    check_module(model, rng.normal(size=(4, 3)), rng)


def test_nested_sequential():
    rng = np.random.default_rng(5)
    model = Sequential(Sequential(Linear(2, 3, rng=rng), Tanh()), Linear(3, 2, bias=False, rng=rng))
    check_module(model, rng.normal(size=(3, 2)), rng)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse(reduction):
    rng = np.random.default_rng(6)
    out, target = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    loss_fn = MSELoss(reduction=reduction)
    value = loss_fn(out, target)
    divisor = out.size if reduction == "mean" else 1
    assert value == pytest.approx(np.sum((out - target) ** 2) / divisor, rel=1e-12)
    np.testing.assert_allclose(
        loss_fn.backward(), numeric_grad(lambda: loss_fn(out, target), out), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy(reduction):
    rng = np.random.default_rng(7)
    logits, labels = rng.normal(size=(5, 4)), rng.integers(0, 4, size=5)
    loss_fn = CrossEntropyLoss(reduction=reduction)
    value = loss_fn(logits, labels)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))  # naive: fine for small logits
    nll = -log_softmax[np.arange(5), labels]
    assert value == pytest.approx(nll.mean() if reduction == "mean" else nll.sum(), rel=1e-12)
    numeric = numeric_grad(lambda: loss_fn(logits, labels), logits)
    np.testing.assert_allclose(loss_fn.backward(), numeric, rtol=RTOL, atol=ATOL)


def test_cross_entropy_is_stable_for_huge_logits():
    loss_fn = CrossEntropyLoss()
    logits = np.array([[1000.0, 0.0, -1000.0], [-1e4, 1e4, 0.0]])
    assert loss_fn(logits, np.array([0, 1])) == 0.0
    assert np.isfinite(loss_fn.backward()).all()
    assert loss_fn(logits, np.array([1, 0])) == pytest.approx((1000.0 + 2e4) / 2)
    np.testing.assert_allclose(loss_fn.backward(), [[0.5, -0.5, 0.0], [-0.5, 0.5, 0.0]], atol=1e-12)


@pytest.mark.parametrize("loss_fn", [MSELoss(reduction="sum"), CrossEntropyLoss(reduction="sum")], ids=repr)
def test_a_whole_model_and_loss(loss_fn):
    rng = np.random.default_rng(8)
    model = Sequential(Linear(3, 5, rng=rng), Tanh(), Linear(5, 4, rng=rng))
    x = rng.normal(size=(6, 3))
    target = rng.normal(size=(6, 4)) if isinstance(loss_fn, MSELoss) else rng.integers(0, 4, size=6)
    loss_fn(model(x), target)
    grad_input = model.backward(loss_fn.backward())

    def objective() -> float:
        return loss_fn(model(x), target)

    np.testing.assert_allclose(grad_input, numeric_grad(objective, x), rtol=RTOL, atol=ATOL)
    for name, param in model.named_parameters():
        np.testing.assert_allclose(param.grad, numeric_grad(objective, param.data), rtol=RTOL, atol=ATOL, err_msg=name)


@settings(max_examples=examples(20))
@given(shards=st.integers(1, 4), per_shard=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_shards_add_up(shards, per_shard, seed):
    """What DDP relies on: summed shard losses and grads are the batch's; equal-shard means average to it."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(shards * per_shard, 3))
    labels = rng.integers(0, 2, size=len(x))
    for reduction, combine in (("sum", np.sum), ("mean", np.mean)):
        whole = Linear(3, 2, rng=seed)
        loss_fn = CrossEntropyLoss(reduction=reduction)
        whole_loss = loss_fn(whole(x), labels)
        whole.backward(loss_fn.backward())
        losses, weight_grads = [], []
        for part in range(shards):
            piece = slice(part * per_shard, (part + 1) * per_shard)
            layer = Linear(3, 2, rng=seed)
            losses.append(loss_fn(layer(x[piece]), labels[piece]))
            layer.backward(loss_fn.backward())
            weight_grads.append(layer.weight.grad)
        assert combine(losses) == pytest.approx(whole_loss, rel=1e-12)
        np.testing.assert_allclose(combine(weight_grads, axis=0), whole.weight.grad, rtol=1e-12, atol=1e-15)
