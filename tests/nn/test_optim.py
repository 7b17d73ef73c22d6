"""SGD and Adam: a naive reference loop, torch.optim (when torch imports), state dicts, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
from ferrodist.nn import SGD, Adam, CrossEntropyLoss, Linear, Parameter, Sequential, Tanh

STEPS = 6


def import_torch():
    """torch if ``import torch`` works (any ImportError, e.g. a broken install, skips)."""
    try:
        import torch
    except ImportError as exc:
        pytest.skip(f"torch does not import: {exc}")
    return torch


def make_params(seed: int = 0) -> list[Parameter]:
    rng = np.random.default_rng(seed)
    return [Parameter(rng.normal(size=(3, 2))), Parameter(rng.normal(size=4))]


def grad_schedule(seed: int = 1) -> list[list[np.ndarray | None]]:
    """Gradients per step; the second parameter has none at step 2 (it must be skipped)."""
    rng = np.random.default_rng(seed)
    steps = []
    for step in range(STEPS):
        steps.append([rng.normal(size=(3, 2)), None if step == 2 else rng.normal(size=4)])
    return steps


def run(opt_factory, seed: int = 0) -> list[np.ndarray]:
    params = make_params(seed)
    opt = opt_factory(params)
    for step_grads in grad_schedule():
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.copy()
        opt.step()
    return [p.data for p in params]


# --- naive references, element by element --------------------------------------------------


def reference_sgd(lr, momentum, weight_decay) -> list[np.ndarray]:
    params = [p.data.copy() for p in make_params()]
    bufs: list[list[float] | None] = [None, None]
    for step_grads in grad_schedule():
        for i, g in enumerate(step_grads):
            if g is None:
                continue
            flat, grad = params[i].reshape(-1), g.reshape(-1)
            d = [grad[k] + weight_decay * flat[k] for k in range(flat.size)]
            if momentum:
                bufs[i] = d if bufs[i] is None else [momentum * b + dk for b, dk in zip(bufs[i], d, strict=True)]
                d = bufs[i]
            for k in range(flat.size):
                flat[k] = flat[k] - lr * d[k]
    return params


def reference_adam(lr, betas, eps, weight_decay) -> list[np.ndarray]:
    params = [p.data.copy() for p in make_params()]
    state = [None, None]
    for step_grads in grad_schedule():
        for i, g in enumerate(step_grads):
            if g is None:
                continue
            flat, grad = params[i].reshape(-1), g.reshape(-1)
            if state[i] is None:
                state[i] = {"t": 0, "m": [0.0] * flat.size, "v": [0.0] * flat.size}
            s = state[i]
            s["t"] += 1
            for k in range(flat.size):
                gk = grad[k] + weight_decay * flat[k]
                s["m"][k] = betas[0] * s["m"][k] + (1 - betas[0]) * gk
                s["v"][k] = betas[1] * s["v"][k] + (1 - betas[1]) * gk * gk
                m_hat = s["m"][k] / (1 - betas[0] ** s["t"])
                v_hat = s["v"][k] / (1 - betas[1] ** s["t"])
                flat[k] = flat[k] - lr * m_hat / (math.sqrt(v_hat) + eps)
    return params


SGD_CASES = [(0.1, 0.0, 0.0), (0.05, 0.9, 0.0), (0.1, 0.5, 0.01)]
ADAM_CASES = [(1e-2, (0.9, 0.999), 1e-8, 0.0), (5e-2, (0.5, 0.9), 1e-3, 0.1)]


@pytest.mark.parametrize(("lr", "momentum", "weight_decay"), SGD_CASES)
def test_sgd_matches_the_reference_loop(lr, momentum, weight_decay):
    got = run(lambda ps: SGD(ps, lr=lr, momentum=momentum, weight_decay=weight_decay))
    for a, b in zip(got, reference_sgd(lr, momentum, weight_decay), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("lr", "betas", "eps", "weight_decay"), ADAM_CASES)
def test_adam_matches_the_reference_loop(lr, betas, eps, weight_decay):
    got = run(lambda ps: Adam(ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
    for a, b in zip(got, reference_adam(lr, betas, eps, weight_decay), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def run_torch(make_opt) -> list[np.ndarray]:
    torch = import_torch()
    params = [torch.tensor(p.data.copy(), requires_grad=True) for p in make_params()]
    opt = make_opt(torch.optim, params)
    for step_grads in grad_schedule():
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else torch.from_numpy(g.copy())
        opt.step()
    return [p.detach().numpy() for p in params]


@pytest.mark.parametrize(("lr", "momentum", "weight_decay"), SGD_CASES)
def test_sgd_matches_torch(lr, momentum, weight_decay):
    want = run_torch(lambda optim, ps: optim.SGD(ps, lr=lr, momentum=momentum, weight_decay=weight_decay))
    got = run(lambda ps: SGD(ps, lr=lr, momentum=momentum, weight_decay=weight_decay))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("lr", "betas", "eps", "weight_decay"), ADAM_CASES)
def test_adam_matches_torch(lr, betas, eps, weight_decay):
    want = run_torch(lambda optim, ps: optim.Adam(ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
    got = run(lambda ps: Adam(ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


def test_training_a_model_matches_torch_end_to_end():
    torch = import_torch()
    rng = np.random.default_rng(3)
    model = Sequential(Linear(4, 6, rng=rng), Tanh(), Linear(6, 3, rng=rng))
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    with torch.no_grad():
        for (_, p), q in zip(model.named_parameters(), net.parameters(), strict=True):
            q.copy_(torch.from_numpy(p.data))
    opt, topt = (
        Adam(model.parameters(), lr=0.01, weight_decay=0.01),
        torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=0.01),
    )
    loss_fn, tloss = CrossEntropyLoss(), torch.nn.CrossEntropyLoss()
    for _ in range(5):
        x, y = rng.normal(size=(8, 4)), rng.integers(0, 3, size=8)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        topt.zero_grad()
        tl = tloss(net(torch.from_numpy(x)), torch.from_numpy(y))
        tl.backward()
        topt.step()
        assert loss == pytest.approx(tl.item(), rel=1e-12)
    for (name, p), q in zip(model.named_parameters(), net.parameters(), strict=True):
        np.testing.assert_allclose(p.data, q.detach().numpy(), rtol=1e-10, atol=1e-13, err_msg=name)


# --- behaviour -------------------------------------------------------------------------------


def test_step_updates_in_place_and_never_touches_grad():
    params = make_params()
    arrays = [p.data for p in params]
    grads = [np.ones(p.shape) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    for opt in (SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1), Adam(params, lr=0.1, weight_decay=0.1)):
        opt.step()
        opt.step()
    assert all(p.data is a for p, a in zip(params, arrays, strict=True))
    assert all(p.grad is g and (g == 1).all() for p, g in zip(params, grads, strict=True))


def test_skipped_parameters_do_not_advance():
    params = make_params()
    params[0].grad = np.ones((3, 2))
    before = params[1].data.copy()
    opt = Adam(params, lr=0.1)
    opt.step()
    opt.step()
    np.testing.assert_array_equal(params[1].data, before)
    assert opt.state_dict()["state"].keys() == {0}
    assert opt.state_dict()["state"][0]["step"] == 2


def test_zero_grad_keeps_views_or_sets_none():
    params = make_params()
    flat = np.ones(10)
    params[0].grad, params[1].grad = flat[:6].reshape(3, 2), flat[6:]
    opt = SGD(params, lr=0.1)
    opt.zero_grad()
    assert np.shares_memory(params[0].grad, flat) and (flat == 0).all()
    opt.zero_grad(set_to_none=True)
    assert params[0].grad is None and params[1].grad is None


@pytest.mark.parametrize(
    "make", [lambda ps: SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01), lambda ps: Adam(ps, lr=0.05)]
)
def test_state_dict_round_trip_continues_identically(make):
    grads = grad_schedule()
    params, clone = make_params(), make_params()
    opt = make(params)
    for step_grads in grads[:3]:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.copy()
        opt.step()
    saved = opt.state_dict()
    for p, c in zip(params, clone, strict=True):
        c.data[...] = p.data
    resumed = make(clone)
    resumed.load_state_dict(saved)
    for entry in saved["state"].values():  # the loaded state is a copy
        for value in entry.values():
            if isinstance(value, np.ndarray):
                value.fill(np.nan)
    for step_grads in grads[3:]:
        for ps in (params, clone):
            for p, g in zip(ps, step_grads, strict=True):
                p.grad = None if g is None else g.copy()
        opt.step()
        resumed.step()
    for p, c in zip(params, clone, strict=True):
        np.testing.assert_array_equal(p.data, c.data)


def test_load_state_dict_restores_hyperparameters():
    opt = Adam(make_params(), lr=0.5, betas=(0.8, 0.9))
    other = Adam(make_params())
    other.load_state_dict(opt.state_dict())
    assert (other.lr, other.betas, other.eps, other.weight_decay) == (0.5, (0.8, 0.9), 1e-8, 0.0)


def test_load_state_dict_errors():
    opt = SGD(make_params(), lr=0.1, momentum=0.9)
    good = {
        "state": {0: {"momentum_buffer": np.zeros((3, 2))}},
        "param_groups": [{"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "params": [0, 1]}],
    }
    opt.load_state_dict(good)
    bad_cases = [
        ({"state": {}}, "keys 'state' and 'param_groups'"),
        ({**good, "param_groups": [{**good["param_groups"][0], "params": [0]}]}, "2 parameters"),
        ({**good, "state": {2: {"momentum_buffer": np.zeros(4)}}}, "parameter 2"),
        ({**good, "state": {1: {"momentum_buffer": np.zeros(3)}}}, r"shape \(3,\)"),
        ({**good, "state": {0: {"momentum": np.zeros((3, 2))}}}, "expected \\['momentum_buffer'\\]"),
        ({**good, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}, "hyperparameters"),
        ({**good, "param_groups": [{**good["param_groups"][0], "lr": -1.0}]}, "lr must be"),
    ]
    for state_dict, match in bad_cases:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(state_dict)
    assert opt.lr == 0.1 and opt.state[0]["momentum_buffer"].shape == (3, 2)  # nothing changed


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: SGD(ps, lr=-0.1), "lr must be a finite number >= 0"),
        (lambda ps: SGD(ps, lr=float("nan")), "lr must be"),
        (lambda ps: SGD(ps, lr=0.1, momentum=-0.5), "momentum must be"),
        (lambda ps: SGD(ps, lr=0.1, weight_decay=-1), "weight_decay must be"),
        (lambda ps: SGD(ps, lr="0.1"), "lr must be a number"),
        (lambda ps: Adam(ps, lr=-1.0), "lr must be"),
        (lambda ps: Adam(ps, betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1.0\)"),
        (lambda ps: Adam(ps, betas=(-0.1, 0.9)), r"betas\[0\] must be"),
        (lambda ps: Adam(ps, betas=(0.9,)), "betas must be a pair"),
        (lambda ps: Adam(ps, eps=-1e-8), "eps must be"),
        (lambda ps: Adam(ps, weight_decay=float("inf")), "weight_decay must be"),
        (lambda ps: SGD([], lr=0.1), "empty parameter list"),
        (lambda ps: SGD([ps[0], ps[0]], lr=0.1), "more than once"),
    ],
)
def test_bad_arguments_are_clear_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make(make_params())


def test_non_parameters_are_type_errors_and_step_revalidates():
    with pytest.raises(TypeError, match="parameter 0 is a ndarray"):
        SGD([np.zeros(2)], lr=0.1)
    params = make_params()
    params[0].grad = np.ones((3, 2))
    opt = SGD(params, lr=0.1)
    opt.lr = -0.1
    with pytest.raises(ValueError, match="lr must be"):
        opt.step()
