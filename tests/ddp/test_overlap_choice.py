"""overlap="auto": a few steps each way, timed, then the faster way stays."""

from __future__ import annotations

import numpy as np
import pytest

from ferrodist.ddp import DDP
from ferrodist.ddp._overlap import TRIALS, WARMUP, OverlapChoice
from ferrodist.testing import run_world


def drive(choice: OverlapChoice, seconds: dict[bool, float], steps: int) -> list[bool]:
    ways = []
    for _ in range(steps):
        way = choice.next()
        ways.append(way)
        choice.record(way, seconds[way])
    return ways


@pytest.mark.parametrize(("on", "off", "kept"), [(1.0, 2.0, True), (2.0, 1.0, False), (1.0, 1.0, True)])
def test_both_ways_are_timed_then_the_faster_stays(on, off, kept):
    choice = OverlapChoice()
    ways = drive(choice, {True: on, False: off}, WARMUP + 2 * TRIALS + 5)
    assert ways[:WARMUP] == [True] * WARMUP  # warm-up steps overlap, untimed
    assert ways[WARMUP : WARMUP + 2 * TRIALS] == [True, False] * TRIALS  # alternating trials
    assert ways[WARMUP + 2 * TRIALS :] == [kept] * 5
    assert choice.chosen is kept
    assert len(choice.times[True]) == len(choice.times[False]) == TRIALS


def test_the_median_decides_not_one_slow_step():
    choice = OverlapChoice()
    for way in [True] * WARMUP:
        choice.record(way, 9.0)
    for k in range(TRIALS):
        choice.record(True, 5.0 if k == 0 else 1.0)  # one slow overlapped step
        choice.record(False, 1.5)
    assert choice.chosen is True


def test_a_bad_overlap_value_is_refused():
    torch = pytest.importorskip("torch")
    from ferrodist.core import InvalidArgument

    def body():
        with pytest.raises(InvalidArgument, match="overlap must be True, False or 'auto'"):
            DDP(torch.nn.Linear(2, 2), overlap="sometimes")

    run_world(1, body)


def test_the_default_chooses_during_training_and_ranks_stay_equal():
    torch = pytest.importorskip("torch")

    def body():
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(5 + model.group.rank)
        for _ in range(WARMUP + 2 * TRIALS + 3):
            opt.zero_grad()
            x = torch.randn(8, 6, generator=gen)
            torch.nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
            opt.step()
        choice = model._reducer.choice
        return (
            choice.chosen,
            [len(t) for t in choice.times.values()],
            [p.detach().numpy().copy() for p in model.parameters()],
        )

    results = run_world(2, body)
    for chosen, trials, params in results:
        assert chosen in (True, False) and trials == [TRIALS, TRIALS]
        for mine, first in zip(params, results[0][2], strict=True):
            np.testing.assert_array_equal(mine, first)  # both ways average alike
