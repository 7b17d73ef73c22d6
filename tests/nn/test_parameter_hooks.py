"""Parameter: validated .data/.grad, in-place accumulation into views, post-accumulate hooks."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
from ferrodist.nn import Linear, MSELoss, Parameter, ReLU, Sequential, Tanh


def mlp(seed: int = 0, dtype=np.float64) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(
        Linear(3, 4, rng=rng, dtype=dtype),
        Tanh(),
        Linear(4, 5, rng=rng, dtype=dtype),
        ReLU(),
        Linear(5, 2, rng=rng, dtype=dtype),
    )


def run_backward(model: Sequential, seed: int) -> None:
    rng = np.random.default_rng(seed)
    loss_fn = MSELoss()
    loss_fn(model(rng.normal(size=(6, 3))), rng.normal(size=(6, 2)))
    model.backward(loss_fn.backward())


# --- Parameter ------------------------------------------------------------------------------


def test_parameter_keeps_the_array_and_its_dtype():
    array = np.zeros((2, 3), np.float32)
    p = Parameter(array)
    assert p.data is array and p.dtype == np.float32 and p.shape == (2, 3) and p.size == 6 and p.grad is None


@pytest.mark.parametrize("data", [np.arange(3), np.array([True]), np.broadcast_to(np.zeros(1), (3,))])
def test_parameter_rejects_integer_and_read_only_data(data):
    with pytest.raises(ValueError, match="Parameter needs"):
        Parameter(data)


def test_first_accumulation_copies_later_ones_add_in_place():
    p = Parameter(np.zeros(3))
    g = np.array([1.0, 2.0, 3.0])
    p.accumulate_grad(g)
    assert p.grad is not g and not np.shares_memory(p.grad, g)
    first = p.grad
    p.accumulate_grad(g)
    assert p.grad is first
    np.testing.assert_array_equal(p.grad, [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(g, [1.0, 2.0, 3.0])


def test_first_accumulation_takes_the_parameters_dtype():
    p = Parameter(np.zeros(2, np.float32))
    p.accumulate_grad(np.array([1.0, 2.0]))
    assert p.grad.dtype == np.float32


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (np.zeros(4), ValueError, "shape"),
        (np.zeros((2, 2), np.float32), ValueError, "dtype float32"),
        (np.zeros((2, 2)).T[::1], None, None),
        ([[0.0, 0.0], [0.0, 0.0]], TypeError, "numpy array"),
        (np.broadcast_to(np.zeros(2), (2, 2)), ValueError, "read-only"),
    ],
)
def test_grad_and_data_setters_validate(value, error, match):
    for attribute in ("grad", "data"):
        p = Parameter(np.zeros((2, 2)))
        if error is None:
            setattr(p, attribute, value)
            assert getattr(p, attribute) is value
        else:
            with pytest.raises(error, match=match):
                setattr(p, attribute, value)
    p.grad = None
    assert p.grad is None


def test_accumulate_grad_rejects_a_wrong_shape_without_broadcasting():
    p = Parameter(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        p.accumulate_grad(np.ones(3))
    assert p.grad is None


# --- gradients in a flat buffer ---------------------------------------------------------------


def test_grads_set_to_views_of_a_flat_buffer_stay_views():
    model, reference = mlp(), mlp()
    params = model.parameters()
    flat = np.full(sum(p.size for p in params) + 3, 7.0)  # 3 spare elements that must stay untouched
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.size].reshape(p.shape)
        p.grad.fill(0)
        offset += p.size
    views = [p.grad for p in params]
    for seed in (1, 2):
        run_backward(model, seed)
        run_backward(reference, seed)
    for p, view in zip(params, views, strict=True):
        assert p.grad is view and np.shares_memory(p.grad, flat)
    np.testing.assert_allclose(
        flat[:offset], np.concatenate([r.grad.ravel() for r in reference.parameters()]), rtol=1e-14
    )
    np.testing.assert_array_equal(flat[offset:], 7.0)

    model.zero_grad()  # in place: the views survive
    assert all(p.grad is view for p, view in zip(params, views, strict=True))
    np.testing.assert_array_equal(flat[:offset], 0.0)
    model.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)


# --- hooks ---------------------------------------------------------------------------------


def test_hooks_fire_once_per_parameter_last_layer_first_with_the_final_grad():
    model = mlp()
    names = {id(p): name for name, p in model.named_parameters()}
    fired = []

    def hook(p):
        # at this moment p.grad is final, and the parameters of earlier layers have none yet
        fired.append((names[id(p)], p.grad.copy(), [names[id(q)] for q in model.parameters() if q.grad is not None]))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    for round_ in range(2):  # the second backward accumulates onto the first
        fired.clear()
        run_backward(model, seed=round_)
        assert [name for name, _, _ in fired] == ["4.weight", "4.bias", "2.weight", "2.bias", "0.weight", "0.bias"]
        for name, grad, _ in fired:
            np.testing.assert_array_equal(grad, dict(model.named_parameters())[name].grad)
    fired.clear()
    model.zero_grad(set_to_none=True)
    run_backward(model, seed=0)
    assert [have for _, _, have in fired] == [
        ["4.weight"],
        ["4.weight", "4.bias"],
        ["2.weight", "4.weight", "4.bias"],
        ["2.weight", "2.bias", "4.weight", "4.bias"],
        ["0.weight", "2.weight", "2.bias", "4.weight", "4.bias"],
        ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"],
    ]


def test_removed_hooks_stop_and_handles_work_as_context_managers():
    model = mlp()
    calls = []
    first, last = model[0].weight, model[4].bias
    handle = first.register_post_accumulate_grad_hook(lambda p: calls.append("first"))
    with last.register_post_accumulate_grad_hook(lambda p: calls.append("last")):
        run_backward(model, 0)
    assert calls == ["last", "first"]
    handle.remove()
    handle.remove()  # harmless
    calls.clear()
    run_backward(model, 1)
    assert calls == []


def test_a_hook_may_remove_another_hook_of_the_same_round():
    p = Parameter(np.zeros(1))
    calls = []
    handles = []
    handles.append(p.register_post_accumulate_grad_hook(lambda q: (calls.append("a"), handles[1].remove())))
    handles.append(p.register_post_accumulate_grad_hook(lambda q: calls.append("b")))
    handles.append(p.register_post_accumulate_grad_hook(lambda q: calls.append("c")))
    p.accumulate_grad(np.ones(1))
    p.accumulate_grad(np.ones(1))
    assert calls == ["a", "c", "a", "c"]


def test_the_same_function_registered_twice_fires_twice():
    p = Parameter(np.zeros(1))
    calls = []

    def hook(q):
        calls.append(1)

    p.register_post_accumulate_grad_hook(hook)
    p.register_post_accumulate_grad_hook(hook).remove()
    p.register_post_accumulate_grad_hook(hook)
    p.accumulate_grad(np.ones(1))
    assert len(calls) == 2


def test_hooks_need_a_callable():
    with pytest.raises(TypeError, match="callable"):
        Parameter(np.zeros(1)).register_post_accumulate_grad_hook(None)
