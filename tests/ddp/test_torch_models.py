"""DDP on PyTorch modules: the same proof, with loss.backward() driving the buckets."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ferrodist.collectives import default_group

pytest.importorskip("ferrodist.ddp", reason="ferrodist-ddp is not installed (pip install packages/ddp)")
from ferrodist.ddp import DDP, bf16_compress, load_checkpoint, save_checkpoint
from ferrodist.testing import run_world

torch = pytest.importorskip("torch")

FEATURES, HIDDEN, CLASSES, STEPS, BATCH = 6, 32, 3, 5, 16


_SEEDING = threading.Lock()  # ranks are threads here, and torch's default generator is global


def make_model(dtype, seed):
    with _SEEDING, torch.random.fork_rng():
        torch.manual_seed(seed)
        return _layers(dtype)


def _layers(dtype):
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    ).to(dtype)


def batches(dtype):
    gen = torch.Generator().manual_seed(11)
    return [
        (torch.randn(BATCH, FEATURES, generator=gen, dtype=dtype), torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(STEPS)
    ]


def optimizer(name, params):
    return (
        torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
        if name == "sgd"
        else torch.optim.Adam(params, lr=0.01)
    )


def reference(name, dtype):
    model = make_model(dtype, 0)
    opt = optimizer(name, model.parameters())
    for x, y in batches(dtype):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def train(name, dtype, device="cpu", **options):
    group = default_group()
    rank, size = group.rank, group.size
    model = DDP(
        make_model(dtype, 10 * rank).to(device), **options
    )  # rank 0 starts like the reference; the broadcast fixes the rest
    opt = optimizer(name, model.parameters())
    per = BATCH // size
    for x, y in batches(dtype):
        opt.zero_grad()  # set_to_none=True, torch's default: the next forward puts the views back
        xs, ys = x[rank * per : (rank + 1) * per].to(device), y[rank * per : (rank + 1) * per].to(device)
        loss = torch.nn.functional.cross_entropy(model(xs), ys)
        loss.backward()  # returns with the gradients averaged over the ranks
        opt.step()
    assert all(b.buffer.device.type == torch.device(device).type for b in model.buckets)
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def difference(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("name", ["sgd", "adam"])
@pytest.mark.parametrize("overlap", [True, False])
def test_torch_model_float64_equals_one_process(size, name, overlap):
    ref = reference(name, torch.float64)
    for state in run_world(
        size, train, name, torch.float64, overlap=overlap, bucket_cap_mb=0.005, first_bucket_cap_mb=0.001
    ):
        assert difference(state, ref) <= 1e-10


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_torch_model_float32_within_stated_tolerance(name):
    ref = reference(name, torch.float32)
    results = run_world(2, train, name, torch.float32)
    for state in results:
        assert difference(state, ref) <= 1e-5 and difference(state, results[0]) == 0.0


def test_torch_gradients_are_bucket_views_and_buckets_start_during_backward():
    def body():
        model = DDP(make_model(torch.float32, 0), bucket_cap_mb=0.005, first_bucket_cap_mb=0.001)
        final = []
        for p in model.module.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: final.append(1))
        started = []

        def hook(bucket):
            started.append(len(final))
            return bucket.group.all_reduce(bucket.buffer, "avg", async_op=True)

        model.register_comm_hook(hook)
        x, y = batches(torch.float32)[0]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        flats = [b.buffer for b in model.buckets]
        views = all(
            any(f.data_ptr() <= p.grad.data_ptr() < f.data_ptr() + f.numel() * f.element_size() for f in flats)
            for p in model.module.parameters()
        )
        return views, started, len(list(model.module.parameters()))

    for views, started, total in run_world(2, body):
        assert views and len(started) > 1 and started[0] < total


def test_a_bucket_of_one_parameter_averages_the_fresh_gradient_where_it_is():
    """PyTorch hands each step's gradient over in a fresh tensor: a bucket of one parameter
    averages that tensor in place (it is then both the gradient and the bucket's buffer);
    only gradients of buckets of several parameters are copied into their bucket. Counted:
    the elements copied per step, against a model where the 32 x 32 weight is alone."""

    def body():
        model = DDP(make_model(torch.float32, 0), bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
        reducer = model._reducer
        copied = []
        real = reducer.model.copy
        reducer.model.copy = lambda dst, src: (copied.append(dst.numel()), real(dst, src))[1]
        opt = optimizer("sgd", model.parameters())
        for x, y in batches(torch.float32):
            opt.zero_grad()
            copied.clear()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        alone = [b.params[0] for b in reducer.plan.buckets if len(b.params) == 1]
        params = list(model.module.parameters())
        shared = sum(params[i].numel() for b in reducer.plan.buckets if len(b.params) > 1 for i in b.params)
        in_place = all(
            reducer.buckets[reducer.bucket_of[i]].buffer.data_ptr() == params[i].grad.data_ptr() for i in alone
        )
        return sum(copied), shared, [params[i].numel() for i in alone], in_place

    for copied, shared, alone, in_place in run_world(2, body):
        assert HIDDEN * HIDDEN in alone and in_place, alone  # the 32 x 32 weight has a bucket of its own
        assert copied == shared  # the last step copied the shared buckets' gradients only


def test_torch_compression_and_checkpoint(tmp_path):
    ref = reference("sgd", torch.float32)

    def body():
        state = train("sgd", torch.float32, comm_hook=bf16_compress)
        model = make_model(torch.float32, 0)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        opt = optimizer("sgd", model.parameters())
        save_checkpoint(tmp_path / "t.pt", model, opt, extra=7)
        fresh = make_model(torch.float32, 3)
        extra = load_checkpoint(tmp_path / "t.pt", fresh, optimizer("sgd", fresh.parameters()))
        return state, extra, difference({k: v.numpy() for k, v in fresh.state_dict().items()}, state)

    for state, extra, reloaded in run_world(2, body):
        assert difference(state, ref) <= 2e-2 and extra == 7 and reloaded == 0.0


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; ``route`` picks the head (the other gets no gradient)."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(FEATURES, HIDDEN)
        self.a = torch.nn.Linear(HIDDEN, CLASSES)
        self.b = torch.nn.Linear(HIDDEN, CLASSES)
        self.route = "a"

    def forward(self, x):
        return getattr(self, self.route)(torch.tanh(self.trunk(x)))


ROUTES = [("a", "b"), ("a", "a"), ("b", "a"), ("b", "b")]  # step 2: head b unused on both ranks


def two_heads(seed):
    with _SEEDING, torch.random.fork_rng():
        torch.manual_seed(seed)
        return TwoHeads().to(torch.float64)


@pytest.mark.parametrize("overlap", [True, False])
def test_torch_unused_parameters_with_gradients_set_to_none(overlap):
    """Gradients dropped by the optimizer come back as fresh tensors, copied into the
    buckets on arrival; a head unused on one rank enters its bucket as zeros there, one
    unused everywhere ends the step with no gradient (so weight decay skips it, as in one
    process)."""
    data = batches(torch.float64)[: len(ROUTES)]
    per = BATCH // 2

    def body():
        rank = default_group().rank
        model = DDP(two_heads(0), find_unused_parameters=True, overlap=overlap, bucket_cap_mb=0.001)
        opt = optimizer("sgd", model.parameters())
        none = []
        for (x, y), routes in zip(data, ROUTES, strict=True):
            opt.zero_grad()
            model.module.route = routes[rank]
            rows = slice(rank * per, (rank + 1) * per)
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            none.append(model.module.b.weight.grad is None)
            opt.step()
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, none

    ref = two_heads(0)
    opt = optimizer("sgd", ref.parameters())
    for (x, y), routes in zip(data, ROUTES, strict=True):
        opt.zero_grad()
        for rank, route in enumerate(routes):
            ref.route = route
            rows = slice(rank * per, (rank + 1) * per)
            (torch.nn.functional.cross_entropy(ref(x[rows]), y[rows]) / 2).backward()
        opt.step()
    expected = {k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}
    for state, none in run_world(2, body):
        assert none == [False, True, False, False]
        assert difference(state, expected) <= 1e-10
