"""Lowering: one source of the messages for the engine and the checker. Every send has
its receive on the peer; validate reads the lowered steps (a lowering without sends
deadlocks there); the engine sends exactly the lowered messages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ferrodist.collectives import default_group
from ferrodist.testing import run_world

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
pytest.importorskip("ferrodist.pipeline", reason="ferrodist-pipeline is not installed (pip install packages/pipeline)")
from ferrodist.pipeline import (
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    ScheduleError,
    ZeroBubbleH1,
    _check,
    _lower,
    _wire,
    lower,
    validate,
)

sys.path.insert(0, str(Path(__file__).parent))
from _pipe import make_data, pipelined_gradients

BUILT_IN = [GPipe(), OneFOneB(), Interleaved1F1B(2), ZeroBubbleH1()]


def test_a_lowered_list_spells_out_the_messages():
    assert [str(step) for step in lower(GPipe(), 2, 2)[0]] == [
        "F0",
        "send activation 0 to rank 1 (boundary 0)",
        "F1",
        "send activation 1 to rank 1 (boundary 0)",
        "recv gradient 0 from rank 1 (boundary 0)",
        "BW0",
        "recv gradient 1 from rank 1 (boundary 0)",
        "BW1",
    ]
    assert [step.kind for step in lower(ZeroBubbleH1(), 1, 1)[0]] == ["F", "B", "W"]  # one stage: no message


@pytest.mark.parametrize("schedule", BUILT_IN, ids=repr)
def test_every_send_has_one_receive_on_its_peer_and_back(schedule):
    for p in range(1, 6):
        for m in range(1, 9):
            lists = lower(schedule, p, m)
            sends = {(r, step.peer, step.message) for r, row in enumerate(lists) for step in row if step.kind == "send"}
            recvs = {(step.peer, r, step.message) for r, row in enumerate(lists) for step in row if step.kind == "recv"}
            assert sends == recvs, (schedule, p, m)
            stages = p * schedule.chunks
            # an activation per boundary and micro-batch forward, a gradient back
            assert len(sends) == 2 * (stages - 1) * m


def test_validate_runs_the_lowered_steps(monkeypatch):
    validate(OneFOneB(), 3, 4)

    def without_sends(actions, rank, n_ranks, chunks):
        return [step for step in _lower.lower_actions(actions, rank, n_ranks, chunks) if step.kind != "send"]

    monkeypatch.setattr(_check, "lower_actions", without_sends)
    with pytest.raises(
        ScheduleError, match=r"rank 1 at its action #0 \(F0, stage 1\) waits for F0 of stage 0, which no"
    ):
        validate(OneFOneB(), 3, 4)


@pytest.mark.parametrize("schedule", [OneFOneB(), Interleaved1F1B(2)], ids=repr)
def test_the_engine_sends_exactly_the_lowered_messages(schedule):
    p, m = 2, 4
    x, y = make_data(8)

    def rank_main():
        group = default_group()
        sent = []
        real = group.isend

        def isend(tensor, dst, tag=0):
            sent.append((dst, tag))
            return real(tensor, dst, tag)

        group.isend = isend  # instance attribute: only this group, only this test
        pipelined_gradients(group, schedule, m, x, y)
        return sent

    results = run_world(p, rank_main)
    lists = lower(schedule, p, m)
    for rank, sent in enumerate(results):
        data = sorted(item for item in sent if item[1] % (1 << _wire._MB_BITS) != 0)  # headers are micro-batch -1
        expected = sorted(
            (step.peer, _wire.tag(step.boundary, step.gradient, step.action.microbatch))
            for step in lists[rank]
            if step.kind == "send" and step.peer != rank
        )
        assert data == expected
