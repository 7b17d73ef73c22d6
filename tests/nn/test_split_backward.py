"""backward_input + backward_weight, stash/restore with micro-batches in flight, and their errors."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
from ferrodist.nn import CrossEntropyLoss, Linear, MSELoss, ReLU, Sequential, Tanh


def mlp(seed: int = 0) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(Linear(3, 5, rng=rng), Tanh(), Linear(5, 4, rng=rng), ReLU(), Linear(4, 2, rng=rng))


def grads(model: Sequential) -> dict[str, np.ndarray]:
    return {name: p.grad.copy() for name, p in model.named_parameters()}


def micro_batches(count: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(4, 3)), rng.normal(size=(4, 2))) for _ in range(count)]


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_backward_input_then_backward_weight_equals_backward():
    split, whole = mlp(), mlp()
    x, g = micro_batches(1)[0]
    split(x)
    whole(x)
    grad_input = split.backward_input(g)
    assert all(p.grad is None for p in split.parameters())  # only the input gradient so far
    split.backward_weight()
    np.testing.assert_array_equal(grad_input, whole.backward(g))
    assert_same(grads(split), grads(whole))


def test_two_micro_batches_in_flight_match_running_them_one_after_another():
    (x0, t0), (x1, t1) = micro_batches(2)
    model, loss_fn = mlp(), MSELoss()

    # the schedule of a zero-bubble stage: F0 F1 B0(input) B1 W0
    loss_fn(model(x0), t0)
    c0, l0 = model.stash(), loss_fn.stash()
    loss_fn(model(x1), t1)
    c1, l1 = model.stash(), loss_fn.stash()
    model.restore(c0)
    loss_fn.restore(l0)
    gx0 = model.backward_input(loss_fn.backward())
    c0 = model.stash()
    model.restore(c1)
    loss_fn.restore(l1)
    gx1 = model.backward(loss_fn.backward())
    assert all(p.grad is not None for p in model.parameters())
    model.restore(c0)
    model.backward_weight()

    reference, ref_loss = mlp(), MSELoss()
    ref_inputs = []
    for x, t in ((x0, t0), (x1, t1)):
        ref_loss(reference(x), t)
        ref_inputs.append(reference.backward(ref_loss.backward()))
    np.testing.assert_array_equal(gx0, ref_inputs[0])
    np.testing.assert_array_equal(gx1, ref_inputs[1])
    assert_same(grads(model), grads(reference))


def test_weight_gradients_of_several_micro_batches_accumulate_into_one_call_per_parameter():
    model, reference = mlp(), mlp()
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    for x, g in micro_batches(3):
        model(x)
        model.backward_input(g)
        reference(x)
        reference.backward(g)
    assert fired == []
    model.backward_weight()  # all three pending inputs, one accumulation (and one hook call) each
    assert fired == ["4.weight", "4.bias", "2.weight", "2.bias", "0.weight", "0.bias"]
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, dict(reference.named_parameters())[name].grad, rtol=1e-13, err_msg=name)


def test_the_forward_keeps_copies_so_callers_may_reuse_their_buffers():
    model, reference = mlp(), mlp()
    (x, g), (other, _) = micro_batches(2)
    buffer, grad_buffer = x.copy(), g.copy()
    model(buffer)
    reference(x)
    buffer[...] = other  # e.g. the next micro-batch received into the same buffer
    model.backward_input(grad_buffer)
    grad_buffer[...] = 0
    model.backward_weight()
    reference.backward(g)
    assert_same(grads(model), grads(reference))


def test_modules_without_parameters_have_a_no_op_backward_weight():
    for module in (ReLU(), Tanh()):
        module(np.ones((2, 2)))
        module.backward_input(np.ones((2, 2)))
        module.backward_weight()
        module.backward_weight()


@pytest.mark.parametrize("module", [Linear(2, 2, rng=0), ReLU(), Tanh(), mlp()], ids=lambda m: type(m).__name__)
def test_backward_without_a_saved_forward_is_a_clear_error(module):
    with pytest.raises(RuntimeError, match="no saved forward"):
        module.backward(np.ones((1, 2)))
    x = np.ones((1, 3 if isinstance(module, Sequential) else 2))
    out = module(x)
    module.backward(np.ones_like(out))
    with pytest.raises(RuntimeError, match="no saved forward"):
        module.backward(np.ones_like(out))  # one backward per forward
    module(x)
    module.stash()
    with pytest.raises(RuntimeError, match="restore"):
        module.backward_input(np.ones_like(out))


def test_losses_need_a_call_before_backward():
    for loss_fn in (MSELoss(), CrossEntropyLoss()):
        with pytest.raises(RuntimeError, match="no saved forward"):
            loss_fn.backward()


def test_linear_backward_weight_needs_a_pending_backward_input():
    layer = Linear(2, 2, rng=0)
    with pytest.raises(RuntimeError, match="nothing pending"):
        layer.backward_weight()
    layer(np.ones((1, 2)))
    layer.backward_input(np.ones((1, 2)))
    layer.backward_weight()
    with pytest.raises(RuntimeError, match="nothing pending"):
        layer.backward_weight()


def test_a_wrong_grad_output_shape_is_refused_and_the_forward_kept():
    layer = Linear(3, 2, rng=0)
    layer(np.ones((4, 3)))
    with pytest.raises(ValueError, match=r"grad_output has shape \(4, 3\)"):
        layer.backward(np.ones((4, 3)))
    layer.backward(np.ones((4, 2)))
    relu = ReLU()
    relu(np.ones((2, 2)))
    with pytest.raises(ValueError, match="grad_output has shape"):
        relu.backward(np.ones(2))


def test_restore_refuses_foreign_reused_and_overwriting_contexts():
    model, other = mlp(), mlp()
    x, g = micro_batches(1)[0]
    model(x)
    ctx = model.stash()
    with pytest.raises(ValueError, match="not stash"):
        other.restore(ctx)
    with pytest.raises(ValueError, match="not stash"):
        model[0].restore(ctx)
    model(x)  # a forward of its own ...
    with pytest.raises(RuntimeError, match="stash\\(\\) them first"):
        model.restore(ctx)  # ... would be lost
    model.stash()
    model.restore(ctx)
    model.backward(g)
    model.stash()
    with pytest.raises(RuntimeError, match="restored before"):
        model.restore(ctx)  # its gradients would count twice


def test_restore_checks_pending_state_of_children_too():
    model = mlp()
    x, g = micro_batches(1)[0]
    model(x)
    ctx = model.stash()
    model(x)
    model.backward_input(g)  # only pending weight gradients remain, deep inside
    with pytest.raises(RuntimeError, match="stash\\(\\) them first"):
        model.restore(ctx)
