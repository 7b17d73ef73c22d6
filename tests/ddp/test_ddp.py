"""DDP's features on in-process ranks: zero copy, overlap, no_sync, unused parameters,
join, hooks, the straggler report, replica checks and checkpoints."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
pytest.importorskip("ferrodist.ddp", reason="ferrodist-ddp is not installed (pip install packages/ddp)")
from _training import (
    CLASSES,
    FEATURES,
    HIDDEN,
    accuracy,
    blobs,
    make_batches,
    make_model,
    make_optimizer,
    max_difference,
    reference_step,
    shard,
)

from ferrodist import nn
from ferrodist.collectives import default_group
from ferrodist.core import CollectiveMismatch, InvalidArgument
from ferrodist.ddp import (
    DDP,
    CheckpointError,
    GradBucket,
    allreduce,
    bf16_compress,
    fp16_compress,
    load_checkpoint,
    powersgd,
    save_checkpoint,
)
from ferrodist.ddp._models import adapt
from ferrodist.testing import run_world

LOSS = nn.CrossEntropyLoss


def step(model, opt, x, y):
    loss_fn = LOSS()
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    model.backward(loss_fn.backward())
    opt.step()
    return loss


def test_gradients_live_in_the_bucket_buffers():
    def body():
        model = DDP(make_model(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0002)
        x, y = make_batches(1, 8)[0]
        loss_fn = LOSS()
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        plan = model.bucket_plan
        params = model.module.parameters()
        for b, bucket in zip(plan.buckets, model.buckets, strict=True):
            for p, offset, numel in zip(b.params, b.offsets, b.numels, strict=True):
                grad = params[p].grad
                assert np.shares_memory(grad, bucket.buffer)
                assert grad.ctypes.data == bucket.buffer.ctypes.data + offset * bucket.buffer.itemsize
                assert grad.size == numel
        # zero_grad keeps the views; set_to_none drops them and the next forward puts them back
        model.module.zero_grad()
        assert all(np.shares_memory(p.grad, model.buckets[0].buffer) or p.grad is not None for p in params)
        model.module.zero_grad(set_to_none=True)
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        return len(plan.buckets), all(any(np.shares_memory(p.grad, b.buffer) for b in model.buckets) for p in params)

    for buckets, views in run_world(2, body):
        assert buckets > 2 and views


def test_overlap_starts_buckets_while_backward_runs():
    def body(overlap):
        model = DDP(make_model(), overlap=overlap, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0002)
        final = []
        for p in model.module.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: final.append(1))
        seen_at_start = []

        def hook(bucket):
            seen_at_start.append(len(final))
            return allreduce(bucket)

        model.register_comm_hook(hook)
        x, y = make_batches(1, 8)[0]
        loss_fn = LOSS()
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        return seen_at_start, len(model.module.parameters())

    for seen, total in run_world(2, body, True):
        assert seen[0] < total and seen == sorted(seen)  # the first bucket left before backward ended
    for seen, total in run_world(2, body, False):
        assert seen == [total] * len(seen)


def test_no_sync_accumulates_like_a_bigger_batch():
    batches = make_batches(6, 8)  # per step: two micro-batches of 8 (4 per rank)

    def body():
        group = default_group()
        model = DDP(make_model(seed=5 * group.rank), bucket_cap_mb=0.001)
        opt = make_optimizer("sgd", model.parameters())
        loss_fn = LOSS()
        for s in range(3):
            opt.zero_grad()
            (x1, y1), (x2, y2) = batches[2 * s], batches[2 * s + 1]
            with model.no_sync():
                loss_fn(model(shard(x1, group.rank, 2)), shard(y1, group.rank, 2))
                model.backward(loss_fn.backward())
            loss_fn(model(shard(x2, group.rank, 2)), shard(y2, group.rank, 2))
            model.backward(loss_fn.backward())
            opt.step()
        return model.state_dict()

    ref = make_model()
    opt = make_optimizer("sgd", ref.parameters())
    for s in range(3):
        shards = [(shard(x, r, 2), shard(y, r, 2)) for x, y in batches[2 * s : 2 * s + 2] for r in range(2)]
        reference_step(ref, opt, shards, divisor=2)
    for state in run_world(2, body):
        assert max_difference(state, ref.state_dict()) <= 1e-10


class Gated(nn.Module):
    """A trunk and two heads; ``route`` picks the head, so the other gets no gradient."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(FEATURES, HIDDEN, rng=0)
        self.a = nn.Linear(HIDDEN, CLASSES, rng=1)
        self.b = nn.Linear(HIDDEN, CLASSES, rng=2)
        self.route = "a"

    def forward(self, x):
        self._saved = self.route
        return getattr(self, self.route)(self.trunk(x))

    def backward_input(self, g):
        route = self._take_saved("backward")
        self._pending.append(route)
        return self.trunk.backward_input(getattr(self, route).backward_input(g))

    def backward_weight(self):
        getattr(self, self._pending.pop()).backward_weight()
        self.trunk.backward_weight()


ROUTES = [("a", "b"), ("a", "a"), ("b", "a")]  # step 2: head b unused on every rank


def test_unused_parameters_are_agreed_across_ranks():
    batches = make_batches(3, 8)

    def body():
        rank = default_group().rank
        model = DDP(Gated(), find_unused_parameters=True, bucket_cap_mb=0.0005)
        opt = make_optimizer("sgd", model.parameters())
        grads_none = []
        for (x, y), routes in zip(batches, ROUTES, strict=True):
            model.module.route = routes[rank]
            step(model, opt, shard(x, rank, 2), shard(y, rank, 2))
            grads_none.append(model.module.b.weight.grad is None)
        return model.state_dict(), grads_none

    ref = Gated()
    opt = make_optimizer("sgd", ref.parameters())
    for (x, y), routes in zip(batches, ROUTES, strict=True):
        shards = [((shard(x, r, 2), shard(y, r, 2)), routes[r]) for r in range(2)]
        loss_fn = LOSS()
        opt.zero_grad(set_to_none=True)
        for (xs, ys), route in shards:
            ref.route = route
            loss_fn(ref(xs), ys)
            ref.backward(loss_fn.backward() / 2)
        opt.step()
    for state, grads_none in run_world(2, body):
        assert grads_none == [False, True, False]  # no rank used head b in step 2: no gradient, no decay
        assert max_difference(state, ref.state_dict()) <= 1e-10


def test_an_unused_parameter_without_the_flag_is_named():
    def body():
        model = DDP(Gated())
        x, y = make_batches(1, 4)[0]
        loss_fn = LOSS()
        loss_fn(model(x), y)
        with pytest.raises(InvalidArgument, match=r"'b\.weight'.*find_unused_parameters=True"):
            model.backward(loss_fn.backward())
        return True

    assert run_world(2, body) == [True, True]


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_with_uneven_inputs_finishes_and_equals_the_reference(divide_by_initial):
    counts = [3, 5, 4]
    data = {r: make_batches(counts[r], 4, seed=40 + r) for r in range(3)}

    def body():
        rank = default_group().rank
        model = DDP(make_model(seed=rank), bucket_cap_mb=0.001)
        opt = make_optimizer("adam", model.parameters())
        with model.join(divide_by_initial_world_size=divide_by_initial):
            for x, y in data[rank]:
                step(model, opt, x, y)
        return model.state_dict()

    ref = make_model()
    opt = make_optimizer("adam", ref.parameters())
    for s in range(max(counts)):
        active = [r for r in range(3) if s < counts[r]]
        reference_step(ref, opt, [data[r][s] for r in active], divisor=3 if divide_by_initial else len(active))
    results = run_world(3, body, timeout=20)
    for state in results:
        # every rank ends with the model of the rank that trained longest (rank 1)
        assert max_difference(state, ref.state_dict()) <= 1e-10


def test_ranks_disagreeing_about_no_sync_inside_join_fail_on_every_rank():
    def body():
        rank = default_group().rank
        model = DDP(make_model())
        x = make_batches(1, 4)[0][0]
        with pytest.raises(CollectiveMismatch, match="no_sync"), model.join():
            if rank == 0:
                with model.no_sync():
                    model(x)
            else:
                model(x)
        return True

    assert run_world(2, body) == [True, True]


@pytest.mark.parametrize(("hook", "tolerance"), [(fp16_compress, 2e-3), (bf16_compress, 2e-2)])
def test_compression_hooks_stay_within_their_tolerance(hook, tolerance):
    def body():
        rank = default_group().rank
        model = DDP(make_model(np.float32), comm_hook=hook)
        opt = make_optimizer("sgd", model.parameters())
        for x, y in make_batches(5, 16, np.float32):
            step(model, opt, shard(x, rank, 2), shard(y, rank, 2))
        return model.state_dict()

    ref = make_model(np.float32)
    opt = make_optimizer("sgd", ref.parameters())
    for x, y in make_batches(5, 16, np.float32):
        reference_step(ref, opt, [(shard(x, r, 2), shard(y, r, 2)) for r in range(2)], divisor=2)
    results = run_world(2, body)
    for state in results:
        assert max_difference(state, results[0]) == 0.0  # compressed, but still identical replicas
        assert max_difference(state, ref.state_dict()) <= tolerance


def test_bf16_compress_of_a_float32_host_bucket_is_one_compressed_average():
    """A float32 bucket on the host is averaged by the group's all_reduce(compress="bf16"):
    the bits of that call (rounded once, averaged in float32, rounded once), and no scaling
    pass or 16-bit buffer of the hook's own (``bucket.state`` stays empty)."""

    def body():
        group = default_group()
        grads = np.linspace(-3, 3, 5000, dtype=np.float32) * (group.rank + 1) / 7
        bucket = GradBucket(0, grads.copy(), (), (), (), group, adapt(make_model(np.float32)), True)
        bf16_compress(bucket).wait()
        want = grads.copy()
        group.all_reduce(want, "avg", compress="bf16")
        return bucket.buffer.tobytes() == want.tobytes(), bucket.state

    assert run_world(2, body) == [(True, {}), (True, {})]


def train_blobs(hook, epochs=8, size=2):
    x, y = blobs()
    train, test = slice(0, 480), slice(480, None)

    def body():
        rank = default_group().rank
        model = DDP(make_model(np.float32), comm_hook=hook() if hook else None)
        opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for _ in range(epochs):
            for i in range(0, 480, 32):
                xs, ys = x[train][i : i + 32], y[train][i : i + 32]
                losses.append(step(model, opt, shard(xs, rank, size), shard(ys, rank, size)))
        return accuracy(model.module, x[test], y[test]), losses

    return run_world(size, body)


def test_powersgd_converges_on_the_demo_task():
    plain = train_blobs(None)
    compressed = train_blobs(lambda: powersgd(rank=2, start_iter=5))
    for (acc, losses), (plain_acc, _) in zip(compressed, plain, strict=True):
        assert acc >= 0.9 and acc >= plain_acc - 0.05
        assert np.mean(losses[-15:]) < 0.5 * np.mean(losses[:15])


def test_replicas_that_differ_are_refused_on_every_rank():
    def body():
        rank = default_group().rank
        hidden = HIDDEN if rank == 0 else HIDDEN + 1
        module = nn.Sequential(nn.Linear(FEATURES, hidden, rng=0), nn.ReLU(), nn.Linear(hidden, CLASSES, rng=1))
        with pytest.raises(CollectiveMismatch) as info:
            DDP(module)
        return str(info.value)

    for message in run_world(2, body):
        assert "parameter/buffer #0" in message and "rank 0: '0.weight' (16, 6)" in message
        assert "rank 1: '0.weight' (17, 6)" in message


class Slow(nn.Module):
    """Sleeps in backward on the ranks it is told to."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        self._saved = True
        return x

    def backward_input(self, g):
        self._take_saved("backward")
        time.sleep(self.seconds)
        return g


def test_the_straggler_report_names_the_slow_rank():
    def body():
        rank = default_group().rank
        lines = []
        module = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN, rng=0), Slow(0.05 if rank == 1 else 0.0), nn.Linear(HIDDEN, CLASSES, rng=1)
        )
        model = DDP(module, report_every=3, report=lines.append, bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001)
        opt = make_optimizer("sgd", model.parameters())
        for x, y in make_batches(6, 8):
            step(model, opt, x, y)
        return model.stats(), lines

    results = run_world(2, body)
    for report, _ in results:
        assert len(report.steps) == 6 and report.slowest_counts() == [0, 6]
        for s in report.steps:
            assert s.compute[1] >= 0.05 > s.compute[0]
            assert s.wait[0] > 0.03  # rank 0 waited for rank 1
            assert len(s.ready[0]) == len(results[0][0].steps[0].ready[0])
    lines0, lines1 = results[0][1], results[1][1]
    assert lines1 == [] and len(lines0) == 2
    assert lines0[0].startswith("ddp steps 1-3: slowest rank 1 in 3 of 3 steps")


def test_checkpoints_are_written_once_and_loaded_everywhere(tmp_path):
    path = tmp_path / "ckpt.bin"

    def body():
        rank = default_group().rank
        model = DDP(make_model())
        opt = make_optimizer("adam", model.parameters())
        for x, y in make_batches(2, 8):
            step(model, opt, shard(x, rank, 2), shard(y, rank, 2))
        save_checkpoint(path, model, opt, extra={"epoch": 2})
        fresh = make_model(seed=9)
        fresh_opt = make_optimizer("adam", fresh.parameters())
        extra = load_checkpoint(path, fresh, fresh_opt)
        with pytest.raises(CheckpointError, match="could not load"):
            load_checkpoint(tmp_path / ("missing" if rank == 1 else "ckpt.bin"), fresh)
        with pytest.raises(CheckpointError, match="rank 0 could not write"):
            save_checkpoint(tmp_path / "no-such-dir" / "x.bin", model)
        return extra, max_difference(fresh.state_dict(), model.state_dict())

    for extra, difference in run_world(2, body):
        assert extra == {"epoch": 2} and difference == 0.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]  # no temporary file left


def test_a_rank_that_fails_mid_training_fails_the_others_instead_of_hanging():
    from ferrodist.core import FerrodistError

    seen = []

    def body():
        rank = default_group().rank
        model = DDP(make_model(), bucket_cap_mb=0.001)
        opt = make_optimizer("sgd", model.parameters())
        for i, (x, y) in enumerate(make_batches(4, 8)):
            if rank == 1 and i == 2:
                raise RuntimeError("rank 1 ran out of memory (on purpose)")
            try:
                step(model, opt, shard(x, rank, 2), shard(y, rank, 2))
            except FerrodistError as exc:
                seen.append((rank, i, str(exc)))
                raise
        return "finished"

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="on purpose"):
        run_world(2, body, timeout=10)
    assert time.monotonic() - started < 10  # rank 0 learnt at once, not at its timeout
    assert len(seen) == 1 and seen[0][:2] == (0, 2) and "rank 1" in seen[0][2], seen
