"""Pipelined gradients equal the unsplit model's: every schedule, 2 and 4 stages, random
micro-batch counts and batch sizes, on the simulated backend; errors fail every stage."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrodist.collectives import default_group
from ferrodist.core import CollectiveMismatch, FerrodistError, GroupAborted, InvalidArgument

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
pytest.importorskip("ferrodist.pipeline", reason="ferrodist-pipeline is not installed (pip install packages/pipeline)")
from ferrodist.nn import CrossEntropyLoss, Linear, Module, MSELoss, Sequential, Tanh
from ferrodist.pipeline import (
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Pipeline,
    ZeroBubbleH1,
    split_sequential,
)
from ferrodist.testing import run_world

sys.path.insert(0, str(Path(__file__).parent))
from _pipe import make_data, make_model, pipelined_gradients, reference_gradients

SCHEDULES = [GPipe(), OneFOneB(), Interleaved1F1B(2), ZeroBubbleH1()]


def check(p, schedule, m, rows, seed=0):
    x, y = make_data(rows, seed)
    loss, expected = reference_gradients(x, y)
    results = run_world(p, lambda: pipelined_gradients(default_group(), schedule, m, x, y))
    seen = {}
    for got_loss, grads in results:
        assert abs(got_loss - loss) <= 1e-12
        seen.update(grads)
    assert set(seen) == set(expected)  # every parameter lives on exactly one stage
    return max(float(np.max(np.abs(seen[k] - expected[k]))) for k in expected)


@settings(max_examples=30, deadline=None)
@given(
    p=st.sampled_from([2, 4]),
    schedule=st.sampled_from(SCHEDULES),
    m=st.integers(1, 6),
    extra=st.integers(0, 9),
    seed=st.integers(0, 1000),
)
def test_gradients_equal_the_unsplit_model(p, schedule, m, extra, seed):
    if p * schedule.chunks > 8:  # the model has 8 layers
        schedule = OneFOneB()
    assert check(p, schedule, m, m + extra, seed) <= 1e-10


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_one_rank_runs_every_schedule(schedule):
    assert check(1, schedule, 3, 7) <= 1e-10


def test_a_smaller_last_microbatch_is_weighted_by_its_rows():
    # 10 rows in 4 micro-batches: 3, 3, 2, 2 rows; the loss is the mean over all 10
    assert check(2, OneFOneB(), 4, 10) <= 1e-10


class Counting(Module):
    """A chunk that counts, in ``tally`` (shared by a rank's chunks), the micro-batch chunks
    between their forward and their weight gradient."""

    def __init__(self, inner, tally):
        super().__init__()
        self.inner = inner
        self.tally = tally
        self._saved = None
        self._pending = []

    def forward(self, x):
        self.tally["live"] += 1
        self.tally["peak"] = max(self.tally["peak"], self.tally["live"])
        return self.inner(x)

    def backward_input(self, g):
        return self.inner.backward_input(g)

    def backward_weight(self):
        self.inner.backward_weight()
        self.tally["live"] -= 1


@pytest.mark.parametrize(
    ("schedule", "bound"),
    [
        (OneFOneB(), lambda p, r, v: p - r),
        (ZeroBubbleH1(), lambda p, r, v: 2 * p - 1 - r),
        (Interleaved1F1B(2), lambda p, r, v: 2 * (p - 1 - r) + (v - 1) * p + 1),
        (GPipe(), lambda p, r, v: 8),
    ],
    ids=repr,
)
def test_activations_held_while_running_stay_within_the_stated_bound(schedule, bound):
    p, m = 4 // schedule.chunks, 8
    x, y = make_data(16)

    def body():
        g = default_group()
        stages = split_sequential(make_model(), p * schedule.chunks)
        tally = {"live": 0, "peak": 0}
        mine = [Counting(stages[c * p + g.rank], tally) for c in range(schedule.chunks)]
        pipe = Pipeline(mine, None, m, schedule)
        pipe.train_step(x if g.rank == 0 else None, y if g.rank == p - 1 else None, CrossEntropyLoss())
        assert tally["live"] == 0
        return tally["peak"]

    peaks = run_world(p, body)
    for rank, peak in enumerate(peaks):
        assert peak <= bound(p, rank, schedule.chunks), (rank, peak)
    assert peaks[0] == bound(p, 0, schedule.chunks)  # rank 0 reaches its bound: it is tight


def test_eval_step_returns_the_unsplit_output_on_the_last_stage():
    x, _ = make_data(9)
    expected = make_model()(x)

    def body():
        g = default_group()
        stage = split_sequential(make_model(), 2)[g.rank]
        return Pipeline(stage, None, 3, OneFOneB()).eval_step(x if g.rank == 0 else None)

    first, last = run_world(2, body)
    assert first is None and np.max(np.abs(last - expected)) <= 1e-12


def test_stages_that_do_not_fit_fail_every_rank_at_once():
    """Stage 0 ends with 8 features, stage 1 starts with 6: the receiving stage names the
    mismatch, and the sender, aborted by it, names it too, long before the deadline."""
    x, y = make_data(4)

    def body():
        g = default_group()
        stage = Sequential(Linear(5, 8, rng=0), Tanh()) if g.rank == 0 else Sequential(Linear(6, 3, rng=1))
        pipe = Pipeline(stage, None, 2, OneFOneB())
        start = time.monotonic()
        with pytest.raises(FerrodistError) as info:
            pipe.train_step(x if g.rank == 0 else None, y if g.rank == 1 else None, CrossEntropyLoss())
        return type(info.value), str(info.value), time.monotonic() - start

    (kind0, text0, t0), (kind1, text1, t1) = run_world(2, body, timeout=30)
    assert kind1 is CollectiveMismatch and "takes inputs of 6 features" in text1
    assert kind0 in (GroupAborted, CollectiveMismatch) and "6 features" in text0
    assert max(t0, t1) < 10


def test_an_exception_in_one_stage_fails_the_others_at_once():
    class Broken(Module):
        def __init__(self):
            super().__init__()
            self._saved = None
            self._pending = []

        def forward(self, x):
            raise RuntimeError("stage 2 broke")

    x, y = make_data(6)

    def body():
        g = default_group()
        stage = Broken() if g.rank == 2 else split_sequential(make_model(), 4)[g.rank]
        pipe = Pipeline(stage, None, 3, OneFOneB())
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            pipe.train_step(x if g.rank == 0 else None, y if g.rank == 3 else None, CrossEntropyLoss())
        return str(info.value), time.monotonic() - start

    for text, took in run_world(4, body, timeout=60):
        assert "stage 2 broke" in text and took < 10


def test_a_rank_that_stalls_is_named_by_every_stage_that_timed_out_behind_it():
    """Rank 1 stalls in its forward: rank 0 and rank 2 time out waiting for it, and rank 3
    for rank 2, which is healthy but waiting too. Whichever of them times out first, every
    error names rank 1 (``waiting_for``)."""
    x, y = make_data(6)

    def body():
        g = default_group()
        stage = split_sequential(make_model(), 4)[g.rank]
        if g.rank == 1:
            forward = stage.forward

            def stalled(inputs):
                time.sleep(4.0)
                return forward(inputs)

            stage.forward = stalled
        pipe = Pipeline(stage, None, 3, OneFOneB())
        with pytest.raises(FerrodistError) as info:
            pipe.train_step(x if g.rank == 0 else None, y if g.rank == 3 else None, CrossEntropyLoss())
        return type(info.value).__name__, str(info.value), info.value.waiting_for

    results = run_world(4, body, timeout=1.5)
    for rank in (0, 2, 3):
        kind, text, waited = results[rank]
        assert kind == "CollectiveTimeout" and waited == (1,), (rank, text)


def test_clear_errors_for_bad_arguments():
    def body():
        stage = split_sequential(make_model(), 2)[default_group().rank]
        with pytest.raises(InvalidArgument, match="runs 2 chunk"):
            Pipeline(stage, None, 2, Interleaved1F1B(2))
        pipe = Pipeline(stage, None, 4, OneFOneB())
        if default_group().rank == 0:
            with pytest.raises(InvalidArgument, match="cannot make 4 micro-batches"):
                pipe.train_step(np.zeros((3, 5)), None, CrossEntropyLoss())
        return True

    assert run_world(2, body) == [True, True]
    with pytest.raises(InvalidArgument, match=r"neither a ferrodist\.nn Module nor a torch"):
        run_world(1, lambda: Pipeline(object(), None, 2, OneFOneB()))


def test_sum_reduction_weights_every_microbatch_by_one():
    x, _ = make_data(6)
    target = np.ones((6, 3))
    ref = make_model()
    loss_fn = MSELoss(reduction="sum")
    expected_loss = loss_fn(ref(x), target)
    ref.backward(loss_fn.backward())

    def body():
        g = default_group()
        stage = split_sequential(make_model(), 2)[g.rank]
        pipe = Pipeline(stage, None, 3, GPipe())
        loss = pipe.train_step(x if g.rank == 0 else None, target if g.rank == 1 else None, MSELoss(reduction="sum"))
        return loss, [p.grad for p in stage.parameters()]

    (_, g0), (loss, g1) = run_world(2, body)
    assert abs(loss - expected_loss) <= 1e-10
    for got, want in zip(g0 + g1, [p.grad for p in ref.parameters()], strict=True):
        assert np.max(np.abs(got - want)) <= 1e-10
