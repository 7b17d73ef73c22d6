"""The launcher's verdict: which rank a failed job is blamed on, from plain values (no processes)."""

from __future__ import annotations

import json
import signal

import pytest

from ferrodist.collectives._failures.record import record_failure
from ferrodist.core import CollectiveMismatch, CollectiveTimeout, PeerLost

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")
from ferrodist.launch._verdict import RankEnd, RankError, diagnose, read_error

TERM, KILL = int(signal.SIGTERM), int(signal.SIGKILL)


def lost(*peers: int) -> RankError:
    return RankError("PeerLost", peers)


def timed_out(*peers: int) -> RankError:
    return RankError("CollectiveTimeout", peers)


def test_a_job_whose_ranks_all_succeed_has_no_culprit_and_no_summary():
    verdict = diagnose([RankEnd(0, 0, 0), RankEnd(1, 0, 1)])
    assert (verdict.exit_code, verdict.culprits, verdict.summary) == (0, (), "")


def test_a_rank_killed_by_a_signal_is_the_cause_even_when_its_reporters_exit_first():
    ends = [RankEnd(0, 1, 0, error=lost(1)), RankEnd(2, 1, 1, error=lost(1)), RankEnd(1, -KILL, 2)]
    verdict = diagnose(ends)
    assert verdict.culprits == (1,) and verdict.exit_code == 128 + KILL
    assert verdict.summary == "ferrodist run: rank 1 was killed by SIGKILL; failed because of it: ranks [0, 2]"


def test_ranks_the_launcher_signalled_are_listed_as_stopped_never_blamed():
    ends = [RankEnd(0, -TERM, 1, stopped=TERM), RankEnd(1, -KILL, 2, stopped=TERM), RankEnd(2, 7, 0)]
    verdict = diagnose(ends)
    assert verdict.culprits == (2,) and verdict.exit_code == 7
    assert verdict.summary == (
        "ferrodist run: rank 2 exited with code 7; stopped by the launcher: ranks [0, 1] "
        "(ranks [1] did not stop and got SIGKILL)"
    )


def test_a_rank_that_failed_with_its_own_error_beats_a_reporter_that_exited_before_it():
    ends = [RankEnd(0, 1, 0, error=lost(1)), RankEnd(1, 3, 1, error=RankError("CollectiveMismatch"))]
    verdict = diagnose(ends)
    assert verdict.culprits == (1,) and verdict.exit_code == 3
    assert verdict.summary == (
        "ferrodist run: rank 1 exited with code 3 (CollectiveMismatch); failed because of it: ranks [0]"
    )


def test_a_rank_without_an_error_file_that_exits_non_zero_failed_on_its_own():
    verdict = diagnose([RankEnd(0, 1, 0, error=lost(1)), RankEnd(1, 2, 1), RankEnd(2, 5, 2)])
    assert verdict.culprits == (1,) and verdict.exit_code == 2
    assert verdict.summary.endswith("; failed because of it: ranks [0]; also failed: ranks [2]")


def test_a_frozen_rank_that_others_timed_out_waiting_for_is_named_though_the_launcher_stopped_it():
    ends = [
        RankEnd(0, 1, 0, error=timed_out(2)),
        RankEnd(1, -TERM, 1, stopped=TERM, error=timed_out(2)),  # stopped after it wrote its error
        RankEnd(2, -TERM, 2, stopped=TERM),
    ]
    verdict = diagnose(ends)
    assert verdict.culprits == (2,)
    assert verdict.exit_code == 1  # the culprit did not fail by itself: the first failure's code
    assert verdict.summary == (
        "ferrodist run: rank 2 did not come to the call in time: ranks [0, 1] timed out waiting for it "
        "(rank 2 was still running when the launcher stopped it); stopped by the launcher: ranks [1, 2]"
    )


def test_a_frozen_rank_that_resumed_and_reported_a_healthy_peer_is_still_the_one_named():
    """Rank 2 was stopped past the deadline: ranks 0 and 1 timed out waiting for it at 100 s.
    It resumed at 103 s and failed too, naming rank 1, which it read from the others'
    failures: every rank reports another, and the first report says who came late."""
    ends = [
        RankEnd(0, 1, 0, error=RankError("CollectiveTimeout", (2,), at=100.0)),
        RankEnd(1, 1, 1, error=RankError("CollectiveTimeout", (2,), at=100.2)),
        RankEnd(2, 1, 2, error=RankError("CollectiveTimeout", (1,), at=103.0)),
    ]
    verdict = diagnose(ends)
    assert verdict.culprits == (2,), verdict.summary
    assert verdict.summary == (
        "ferrodist run: rank 2 did not come to the call in time: ranks [0, 1] timed out waiting for it "
        "(rank 2 exited with code 1)"
    ), verdict.summary


def test_reports_that_blame_each_other_without_times_fall_back_to_the_first_rank_to_fail():
    ends = [RankEnd(0, 1, 1, error=timed_out(1)), RankEnd(1, 1, 0, error=timed_out(0))]
    assert diagnose(ends).culprits == (1,)


def test_an_error_file_says_when_it_was_written(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("FERRODIST_ERROR_FILE", str(path))
    record_failure(CollectiveTimeout("rank 0: waited", rank=0, waiting_for=(1,)))
    error = read_error(str(path))
    assert error is not None and error.blames == (1,) and error.at is not None and error.at > 1.6e9


def test_a_rank_that_left_early_is_named_by_the_ranks_that_lost_it():
    ends = [RankEnd(0, 1, 1, error=lost(2)), RankEnd(1, 1, 2, error=lost(2)), RankEnd(2, 0, 0)]
    verdict = diagnose(ends)
    assert verdict.culprits == (2,)
    assert verdict.summary == (
        "ferrodist run: rank 2 was lost: ranks [0, 1] lost their connection to it (rank 2 exited with code 0)"
    )


def test_reporters_of_reporters_lead_back_to_the_root_cause():
    # Rank 0 timed out waiting for rank 3 and left; rank 1 then lost rank 0 (its store),
    # rank 2 lost rank 3 when the launcher stopped it.
    ends = [
        RankEnd(0, 1, 0, error=timed_out(0, 3)),  # its own rank is ignored
        RankEnd(1, 1, 1, error=lost(0)),
        RankEnd(2, 1, 2, error=lost(3)),
        RankEnd(3, -TERM, 3, stopped=TERM),
    ]
    verdict = diagnose(ends)
    assert verdict.culprits == (3,)
    assert verdict.summary.startswith("ferrodist run: rank 3 was missing: ranks [0, 2] failed waiting for it")


def test_ranks_that_only_blame_each_other_fall_back_to_the_first_failure():
    verdict = diagnose([RankEnd(0, 1, 1, error=lost(1)), RankEnd(1, 1, 0, error=lost(0))])
    assert verdict.culprits == (1,) and verdict.exit_code == 1
    assert verdict.summary == "ferrodist run: rank 1 exited with code 1"


def test_an_interrupted_job_blames_no_rank():
    ends = [RankEnd(0, 0, 0), RankEnd(1, -int(signal.SIGINT), 1, stopped=int(signal.SIGINT))]
    ends.append(RankEnd(2, -KILL, 2, stopped=int(signal.SIGINT)))
    verdict = diagnose(ends, interrupted=int(signal.SIGINT))
    assert verdict.culprits == () and verdict.exit_code == 128 + signal.SIGINT
    assert verdict.summary == (
        "ferrodist run: interrupted by SIGINT, passed on to ranks [1, 2] (ranks [2] did not stop and got SIGKILL)"
    )


def test_the_error_file_ferrodist_writes_is_the_one_the_launcher_reads(tmp_path, monkeypatch):
    path = tmp_path / "rank0.json"
    monkeypatch.setenv("FERRODIST_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "0")
    record_failure(CollectiveTimeout("rank 0: all_reduce #2 timed out", rank=0, waiting_for=(0, 2, 3)))
    record_failure(PeerLost("rank 0: lost rank 1", peer=1))  # a later error: the first one stays
    found = read_error(str(path))
    assert found is not None and found.at is not None
    assert (found.name, found.blames, found.message) == ("CollectiveTimeout", (2, 3), "rank 0: all_reduce #2 timed out")
    assert json.loads(path.read_text())["rank"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json"]  # no partial file left


@pytest.mark.parametrize(
    ("error", "blames"),
    [
        (PeerLost("lost rank 2", peer=2), (2,)),
        (PeerLost("this transport is closed", peer=1, rank=1), ()),  # its own rank: its own error
        (CollectiveMismatch("rank 2 is in another call", rank=1, peer=2), ()),
    ],
)
def test_what_an_error_blames(tmp_path, monkeypatch, error, blames):
    path = tmp_path / "rank1.json"
    monkeypatch.setenv("FERRODIST_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "1")
    record_failure(error)
    found = read_error(str(path))
    assert found is not None and found.blames == blames and found.name == type(error).__name__


def test_no_variable_no_file_and_a_broken_file_is_no_record(tmp_path, monkeypatch):
    monkeypatch.delenv("FERRODIST_ERROR_FILE", raising=False)
    record_failure(PeerLost("x", peer=1))
    assert list(tmp_path.iterdir()) == []
    assert read_error(str(tmp_path / "missing.json")) is None
    for text in ('{"error": "PeerLo', "[]", '{"blames": [1]}', '{"error": "PeerLost", "blames": ["x"]}'):
        (tmp_path / "bad.json").write_text(text)
        assert read_error(str(tmp_path / "bad.json")) is None


def test_several_ranks_can_be_to_blame():
    ends = [RankEnd(0, 1, 0, error=lost(1, 2)), RankEnd(1, 0, 1), RankEnd(2, -TERM, 2, stopped=TERM)]
    verdict = diagnose(ends)
    assert verdict.culprits == (1, 2) and verdict.exit_code == 1
    assert verdict.summary == (
        "ferrodist run: ranks [1, 2] were lost: ranks [0] lost their connection to them (rank 1 exited with "
        "code 0; rank 2 was still running when the launcher stopped it); stopped by the launcher: ranks [2]"
    )


def test_a_rank_with_its_own_error_stopped_on_its_way_out_is_the_cause():
    """A pipeline rank whose stage raised wrote its own error, then was still in its cleanup
    when the launcher stopped it: it is the cause, not a rank that "was still running"."""
    ends = [
        RankEnd(0, 1, 0, error=RankError("FerrodistError", (2,), "rank 0: irecv ...: rank 2: ValueError: boom")),
        RankEnd(1, -15, 2, stopped=15, error=RankError("FerrodistError", (2,), "rank 1: ...")),
        RankEnd(2, -15, 3, stopped=15, error=RankError("FerrodistError", (), "rank 2: ValueError: boom")),
        RankEnd(3, -15, 1, stopped=15),
    ]
    verdict = diagnose(ends)
    assert verdict.culprits == (2,)
    assert verdict.summary.startswith(
        "ferrodist run: rank 2 failed with FerrodistError: ValueError: boom (the launcher stopped it on its way out)"
    ), verdict.summary
    assert "still running" not in verdict.summary


def test_a_rank_stopped_while_waiting_is_never_blamed_for_its_own_timeout():
    """A timeout is about the ranks waited for, even when the record names none."""
    ends = [
        RankEnd(0, 1, 0, error=RankError("CollectiveTimeout", (3,), "rank 0: ... rank 3 ...")),
        RankEnd(1, -15, 1, stopped=15, error=RankError("CollectiveTimeout", (), "rank 1: waiting")),
        RankEnd(3, -15, 2, stopped=15),
    ]
    verdict = diagnose(ends)
    assert verdict.culprits == (3,), verdict.summary
