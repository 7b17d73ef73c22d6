"""Module bookkeeping (names, modes, state dicts, buffers), the layers' arguments, float32 end to end."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
from ferrodist.nn import SGD, Adam, CrossEntropyLoss, Linear, Module, MSELoss, Parameter, ReLU, Sequential, Tanh


def mlp(seed: int = 0, dtype=np.float64) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(Linear(3, 4, rng=rng, dtype=dtype), ReLU(), Linear(4, 2, rng=rng, dtype=dtype))


class Scaled(Module):
    """A user-written module: one parameter, one buffer, a child."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Linear(2, 2, rng=0)
        self.scale = Parameter(np.array([2.0]))
        self.register_buffer("running", np.zeros(2))

    def forward(self, x):
        self._saved = self.inner(x)
        return self.scale.data * self._saved

    def backward_input(self, grad_output):
        y = self._take_saved("backward_input")
        self._pending.append((y, grad_output))
        return self.inner.backward_input(self.scale.data * grad_output)

    def backward_weight(self):
        pending, self._pending = self._pending, []
        self.scale.accumulate_grad(np.array([sum(float(np.sum(y * g)) for y, g in pending)]))
        self.inner.backward_weight()


# --- names and registration ------------------------------------------------------------------


def test_named_parameters_in_registration_order():
    model = Sequential(
        Linear(2, 3, rng=0), Tanh(), Sequential(Linear(3, 3, bias=False, rng=1), ReLU()), Linear(3, 1, rng=2)
    )
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.0.weight", "3.weight", "3.bias"]
    assert model.parameters() == [p for _, p in model.named_parameters()]
    assert model.buffers() == [] and model.named_buffers() == []


def test_a_shared_parameter_is_listed_once_and_gets_both_uses_gradients():
    model = Sequential(Linear(2, 2, rng=0), Tanh(), Linear(2, 2, bias=False, rng=1))
    model[2].weight = model[0].weight  # tied weights
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias"]
    calls = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.copy()))
    x, g = np.array([[0.5, -1.0]]), np.array([[1.0, 2.0]])
    model(x)
    model.backward(g)
    w, h = model[0].weight.data, np.tanh(x @ model[0].weight.data.T + model[0].bias.data)
    first_use = ((g @ w) * (1 - h * h)).T @ x
    np.testing.assert_allclose(model[0].weight.grad, g.T @ h + first_use, rtol=1e-14)
    assert len(calls) == 2  # accumulated (and announced) once per use
    np.testing.assert_array_equal(calls[1], model[0].weight.grad)


def test_a_module_used_twice_in_a_sequential_is_refused():
    layer = Linear(2, 2, rng=0)
    with pytest.raises(ValueError, match="repeats the module"):
        Sequential(layer, ReLU(), layer)
    with pytest.raises(ValueError, match="repeats the module"):
        Sequential(Sequential(ReLU(), layer), layer)


def test_user_modules_register_parameters_buffers_and_children():
    module = Scaled()
    # a module's own parameters first, then each child's (as PyTorch)
    assert [name for name, _ in module.named_parameters()] == ["scale", "inner.weight", "inner.bias"]
    assert [name for name, _ in module.named_buffers()] == ["running"]
    assert list(module.state_dict()) == ["scale", "inner.weight", "inner.bias", "running"]
    module.scale = None  # reassigning to a non-parameter unregisters it
    assert [name for name, _ in module.named_parameters()] == ["inner.weight", "inner.bias"]
    module.running = np.ones(2)  # a buffer's name takes a new array
    assert module.buffers()[0] is module.running
    module.running = None
    assert module.buffers() == []


def test_a_user_module_backward_matches_its_split_backward():
    whole, split = Scaled(), Scaled()
    x, g = np.arange(6.0).reshape(3, 2), np.ones((3, 2))
    whole(x)
    split(x)
    np.testing.assert_array_equal(whole.backward(g), split.backward_input(g))
    split.backward_weight()
    for (name, a), (_, b) in zip(whole.named_parameters(), split.named_parameters(), strict=True):
        np.testing.assert_array_equal(a.grad, b.grad, err_msg=name)
    assert whole.scale.grad[0] == pytest.approx(np.sum(whole.inner(x)))


def test_forgetting_super_init_is_a_clear_error():
    class Broken(Module):
        def __init__(self) -> None:
            self.weight = Parameter(np.zeros(1))

    with pytest.raises(AttributeError, match=r"super\(\).__init__\(\)"):
        Broken()


def test_train_and_eval_reach_every_child():
    model = Sequential(Linear(2, 2, rng=0), Sequential(ReLU()))
    assert model.training and model[1][0].training
    assert model.eval() is model
    assert not model.training and not model[0].training and not model[1][0].training
    model.train()
    assert model[1][0].training


def test_zero_grad_fills_in_place_or_sets_none():
    model = mlp()
    model(np.ones((2, 3)))
    model.backward(np.ones((2, 2)))
    before = [p.grad for p in model.parameters()]
    model.zero_grad()
    assert all(p.grad is g and not g.any() for p, g in zip(model.parameters(), before, strict=True))
    model.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


# --- state dicts -----------------------------------------------------------------------------


def test_state_dict_round_trip_copies_into_the_existing_arrays():
    source, target = mlp(0), mlp(1)
    state = source.state_dict()
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert not any(np.shares_memory(state[name], p.data) for name, p in source.named_parameters())
    arrays = [p.data for p in target.parameters()]
    target.load_state_dict(state)
    assert all(p.data is a for p, a in zip(target.parameters(), arrays, strict=True))
    for (name, p), (_, q) in zip(source.named_parameters(), target.named_parameters(), strict=True):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)
    state["0.weight"][...] = 0  # the state dict is a copy
    assert source[0].weight.data.any() and target[0].weight.data.any()


def test_load_state_dict_errors_name_every_problem_and_write_nothing():
    model = mlp()
    before = model.state_dict()
    state = mlp(1).state_dict()
    del state["0.bias"]
    state["3.weight"] = np.zeros(2)
    state["2.weight"] = np.zeros((4, 2))
    with pytest.raises(
        ValueError, match=r"missing keys \['0.bias'\].*unexpected keys \['3.weight'\].*'2.weight' has shape \(4, 2\)"
    ):
        model.load_state_dict(state)
    with pytest.raises(TypeError, match="cannot become float64"):
        model.load_state_dict({**before, "0.bias": np.zeros(4, np.complex128)})
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_load_state_dict_casts_between_float_dtypes():
    model32, model64 = mlp(0, np.float32), mlp(1)
    model32.load_state_dict(model64.state_dict())
    assert model32[0].weight.dtype == np.float32
    np.testing.assert_allclose(model32[0].weight.data, model64[0].weight.data, rtol=1e-6)


# --- layers' arguments -------------------------------------------------------------------------


def test_linear_initialisation():
    layer = Linear(16, 8, rng=0)
    assert layer.weight.shape == (8, 16) and layer.bias.shape == (8,)
    assert np.abs(layer.weight.data).max() <= 0.25 and np.abs(layer.bias.data).max() <= 0.25
    np.testing.assert_array_equal(layer.weight.data, Linear(16, 8, rng=np.random.default_rng(0)).weight.data)
    assert not np.array_equal(layer.weight.data, Linear(16, 8, rng=1).weight.data)
    assert Linear(2, 3, bias=False).bias is None
    assert repr(layer) == "Linear(in_features=16, out_features=8, bias=True)"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"in_features": 0, "out_features": 2}, "in_features must be a positive integer"),
        ({"in_features": 2, "out_features": 2.0}, "out_features must be"),
        ({"in_features": True, "out_features": 2}, "in_features must be"),
        ({"in_features": 2, "out_features": 2, "dtype": np.int32}, "floating point"),
    ],
)
def test_linear_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Linear(**kwargs)


def test_linear_forward_checks_the_input_shape():
    layer = Linear(3, 2, rng=0)
    for x in (np.ones(3), np.ones((2, 4)), np.ones((1, 2, 3))):
        with pytest.raises(ValueError, match=r"expected input of shape \(batch, 3\)"):
            layer(x)


def test_losses_check_their_arguments():
    with pytest.raises(ValueError, match="reduction must be"):
        MSELoss(reduction="none")
    with pytest.raises(ValueError, match="target has shape"):
        MSELoss()(np.ones((2, 2)), np.ones(2))
    with pytest.raises(ValueError, match="floating point"):
        MSELoss()(np.ones(2, np.int64), np.ones(2))
    ce = CrossEntropyLoss()
    with pytest.raises(ValueError, match="targets must be integers"):
        ce(np.ones((2, 3)), np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 3\)"):
        ce(np.ones((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="logits must have shape"):
        ce(np.ones(3), np.array([0]))
    with pytest.raises(ValueError, match="empty batch"):
        ce(np.ones((0, 3)), np.array([], np.int64))
    assert CrossEntropyLoss(reduction="sum")(np.ones((0, 3)), np.array([], np.int64)) == 0.0


def test_sequential_container_protocol():
    layers = [Linear(2, 3, rng=0), ReLU(), Linear(3, 1, rng=1)]
    model = Sequential(*layers)
    assert len(model) == 3 and list(model) == layers and model[-1] is layers[2]
    tail = model[1:]
    assert isinstance(tail, Sequential) and list(tail) == layers[1:]
    assert [name for name, _ in tail.named_parameters()] == ["1.weight", "1.bias"]
    assert tail.parameters()[0] is layers[2].weight  # a stage shares the model's parameters
    with pytest.raises(TypeError, match="argument 1 is a function, not a Module"):
        Sequential(ReLU(), lambda x: x)
    assert "(2): Linear(in_features=3, out_features=1, bias=True)" in repr(model)


# --- float32 --------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [SGD, Adam])
@pytest.mark.parametrize("loss_fn", [MSELoss(), CrossEntropyLoss()], ids=repr)
def test_float32_end_to_end(optimizer, loss_fn):
    rng = np.random.default_rng(0)
    model = Sequential(Linear(4, 8, rng=rng, dtype=np.float32), Tanh(), Linear(8, 3, rng=rng, dtype=np.float32))
    opt = optimizer(model.parameters(), lr=0.2 if optimizer is SGD else 0.05)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    target = rng.normal(size=(16, 3)).astype(np.float32) if isinstance(loss_fn, MSELoss) else rng.integers(0, 3, 16)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        out = model(x)
        assert out.dtype == np.float32
        losses.append(loss_fn(out, target))
        grad = loss_fn.backward()
        assert grad.dtype == np.float32
        assert model.backward(grad).dtype == np.float32
        opt.step()
    assert all(p.data.dtype == np.float32 and p.grad.dtype == np.float32 for p in model.parameters())
    assert losses[-1] < 0.9 * losses[0]


def test_children_and_modules_walk_the_tree_in_registration_order():
    from ferrodist import nn

    inner = nn.Sequential(nn.Linear(2, 3, rng=0), nn.ReLU())
    model = nn.Sequential(inner, nn.Linear(3, 1, rng=1))
    assert list(model.children()) == [inner, model[1]]
    assert [type(m).__name__ for m in model.modules()] == ["Sequential", "Sequential", "Linear", "ReLU", "Linear"]
    assert list(nn.ReLU().children()) == []
