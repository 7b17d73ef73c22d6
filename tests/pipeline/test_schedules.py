"""Schedules as data: validate accepts every built-in and rejects broken lists; simulate
gives the closed-form bubbles; the activation bounds hold; timelines render."""

from __future__ import annotations

import pytest

from ferrodist.core import InvalidArgument

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
pytest.importorskip("ferrodist.pipeline", reason="ferrodist-pipeline is not installed (pip install packages/pipeline)")
from ferrodist.nn import Linear, ReLU, Sequential
from ferrodist.pipeline import (
    Action,
    CustomSchedule,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    ScheduleError,
    ZeroBubbleH1,
    simulate,
    split_sequential,
    validate,
)

BUILT_IN = [GPipe(), OneFOneB(), Interleaved1F1B(2), Interleaved1F1B(3), ZeroBubbleH1()]


@pytest.mark.parametrize("schedule", BUILT_IN, ids=repr)
def test_validate_accepts_every_built_in_schedule(schedule):
    for p in range(1, 9):
        for m in range(1, 17):
            validate(schedule, p, m)
            lists = schedule.all_actions(p, m)
            assert sum(len(a) for a in lists) == p * schedule.chunks * m * (3 if schedule == ZeroBubbleH1() else 2)


def test_the_bubble_fractions_match_the_closed_forms():
    for p in range(1, 9):
        for m in range(1, 17):
            closed = (p - 1) / (m + p - 1)
            assert simulate(GPipe(), p, m).bubble_fraction == pytest.approx(closed, abs=1e-12)
            assert simulate(OneFOneB(), p, m).bubble_fraction == pytest.approx(closed, abs=1e-12)
            if m % p == 0:
                for v in (2, 3, 4):
                    got = simulate(Interleaved1F1B(v), p, m).bubble_fraction
                    assert got == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)
            if m >= p:
                got = simulate(ZeroBubbleH1(), p, m).bubble_fraction
                assert got == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12), (p, m)


def test_zero_bubble_cuts_the_1f1b_bubble_to_a_third():
    zb = simulate(ZeroBubbleH1(), 4, 8).bubble_fraction
    one = simulate(OneFOneB(), 4, 8).bubble_fraction
    assert zb <= 0.45 * one
    assert zb / one == pytest.approx((3 / 27) / (3 / 11))


def test_activation_bounds():
    for p in range(1, 9):
        for m in range(1, 17):
            peaks = simulate(OneFOneB(), p, m).peak_activations
            assert all(peak <= p - r for r, peak in enumerate(peaks))
            assert peaks[0] == min(p, m)
            assert simulate(GPipe(), p, m).peak_activations == (m,) * p
            zb = simulate(ZeroBubbleH1(), p, m).peak_activations
            assert all(peak <= 2 * p - 1 - r for r, peak in enumerate(zb))
            for v in (2, 3):
                il = simulate(Interleaved1F1B(v), p, m).peak_activations
                if m % p == 0:  # (otherwise the warm-up grows to make the order run)
                    assert all(peak <= min(2 * (p - 1 - r) + (v - 1) * p + 1, v * m) for r, peak in enumerate(il))
                    assert il[0] == min(2 * (p - 1) + (v - 1) * p + 1, v * m)


def test_costs_change_the_timeline():
    equal = simulate(OneFOneB(), 4, 8)
    slow_backward = simulate(OneFOneB(), 4, 8, costs={"F": 1, "B": 2, "W": 2})
    assert slow_backward.makespan == pytest.approx(11 * 5)  # (m + p - 1) (F + BW)
    assert equal.makespan == pytest.approx(11 * 3)
    by_stage = simulate(OneFOneB(), 2, 2, costs=lambda action, stage: 2.0 if stage == 1 else 1.0)
    assert by_stage.makespan > simulate(OneFOneB(), 2, 2).makespan
    with pytest.raises(InvalidArgument, match="unknown kinds"):
        simulate(OneFOneB(), 2, 2, costs={"X": 1})


def test_validate_rejects_broken_lists():
    good = OneFOneB().all_actions(2, 2)
    validate(CustomSchedule(good), 2, 2)
    swapped = [list(good[0]), list(good[1])]
    swapped[1][0], swapped[1][1] = swapped[1][1], swapped[1][0]  # rank 1: BW0 before F0
    with pytest.raises(ScheduleError, match=r"rank 1: BW0 comes before its forward F0"):
        validate(CustomSchedule(swapped), 2, 2)
    missing = [list(good[0]), [a for a in good[1] if a.microbatch != 1]]
    with pytest.raises(
        ScheduleError, match=r"rank 1: no F1: stage 0's output for micro-batch 1 would never be received"
    ):
        validate(CustomSchedule(missing), 2, 2)
    no_w = CustomSchedule([["F0", "B0"], ["F0", "BW0"]])
    with pytest.raises(ScheduleError, match="no W0"):
        validate(no_w, 2, 1)
    twice = CustomSchedule([["F0", "BW0", "BW0"], ["F0", "BW0"]])
    with pytest.raises(ScheduleError, match="twice"):
        validate(twice, 2, 1)
    w_first = CustomSchedule([["F0", "W0", "B0"], ["F0", "BW0"]])
    with pytest.raises(ScheduleError, match="before its input gradient"):
        validate(w_first, 2, 1)
    # every list complete and locally ordered, but the two ranks wait for each other
    deadlock = CustomSchedule([["F0", "BW0", "F1", "BW1"], ["F1", "F0", "BW0", "BW1"]])
    with pytest.raises(ScheduleError) as info:
        validate(deadlock, 2, 2)
    assert "deadlocks: rank 0 at its action #1 (BW0, stage 0) waits for B0 of stage 1 (rank 1's action #2)" in str(
        info.value
    )
    assert "rank 1 at its action #0 (F1, stage 1) waits for F1 of stage 0 (rank 0's action #2)" in str(info.value)
    with pytest.raises(ScheduleError, match="names chunk 1"):
        validate(CustomSchedule([["F0", "BW0", "F0.1"]], chunks=1), 1, 1)


def test_actions_read_and_print():
    s = CustomSchedule([["F0", "B0", "W0", "F1.1", "BW1.1"]])
    assert s.all_actions(1, 2)[0][3] == Action("F", 1, 1)
    assert [str(a) for a in s.all_actions(1, 2)[0]] == ["F0", "B0", "W0", "F1.1", "BW1.1"]
    with pytest.raises(InvalidArgument, match=r"cannot read action 'X3'"):
        CustomSchedule([["X3"]])
    with pytest.raises(InvalidArgument, match="kind must be one of"):
        Action("Q", 0)
    with pytest.raises(InvalidArgument, match=r"rank must be in 0\.\.1"):
        OneFOneB().actions(2, 2, 4)
    assert OneFOneB().actions(1, 2, 3) == [
        Action("F", 0),
        Action("BW", 0),
        Action("F", 1),
        Action("BW", 1),
        Action("F", 2),
        Action("BW", 2),
    ]


@pytest.mark.parametrize("schedule", [GPipe(), OneFOneB(), Interleaved1F1B(2), ZeroBubbleH1()])
def test_action_parse_inverts_str(schedule):
    for actions in schedule.all_actions(4, 8):
        assert [Action.parse(str(a)) for a in actions] == actions
    assert Action.parse("BW12.3") == Action("BW", 12, 3) and Action.parse("F3.0") == Action("F", 3)
    for bad in ("", "F", "X3", "F-1", "F3.", "F 3", "f3", "F3.1.2", "F\u00b2", 3):
        with pytest.raises(InvalidArgument, match=r"Action\.parse: cannot read action"):
            Action.parse(bad)


def test_render_text_draws_one_row_per_rank():
    timeline = simulate(OneFOneB(), 4, 8)
    text = timeline.render_text()
    lines = text.splitlines()
    assert lines[0].startswith("OneFOneB(): 4 ranks, 8 micro-batches, bubble 27.3%")
    assert [line.split("|")[0].strip() for line in lines[1:]] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert lines[4].split("|")[1].startswith(".   .   .   F0  BW0")  # the last rank starts at t = 3
    for line in lines[1:]:
        cells = line.split("|")[1]
        assert all(f"F{i} " in cells + " " and f"BW{i}" in cells for i in range(8))


def test_render_png_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zb.png"
    simulate(ZeroBubbleH1(), 4, 8).render_png(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_picture_has_a_legend_of_the_action_kinds():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    for schedule, kinds in (
        (ZeroBubbleH1(), ["F: forward", "B: backward (input)", "W: backward (weights)"]),
        (GPipe(), ["F: forward", "BW: backward"]),
    ):
        fig = simulate(schedule, 4, 8).figure()
        legend = fig.axes[0].get_legend()
        assert [t.get_text() for t in legend.get_texts()] == kinds
        plt.close(fig)


def test_split_sequential_balances_parameters_or_takes_cuts():
    model = Sequential(Linear(4, 100, rng=0), ReLU(), Linear(100, 4, rng=1), ReLU(), Linear(4, 4, rng=2))
    stages = split_sequential(model, 2)
    counts = [sum(p.data.size for p in s.parameters()) for s in stages]
    assert counts == [500, 424]  # 500 vs 424 is the most even cut
    assert [len(list(s)) for s in split_sequential(model, 5, by="layers")] == [1, 1, 1, 1, 1]
    assert [len(list(s)) for s in split_sequential(model, 2, cuts=[1])] == [1, 4]
    assert next(iter(stages[0])) is next(iter(model))  # the layers are shared, not copied
    with pytest.raises(InvalidArgument, match=r"n_stages must be in 1\.\.5"):
        split_sequential(model, 6)
    with pytest.raises(InvalidArgument, match="cuts must be 1 increasing"):
        split_sequential(model, 2, cuts=[0])
    with pytest.raises(InvalidArgument, match="by must be"):
        split_sequential(model, 2, by="flops")
