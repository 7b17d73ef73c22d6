"""Following waits: a rank that timed out waiting for one peer's message (or whose receive
a peer's timeout failed) reads the other ranks' abort notices to find the rank that held
them all up (``_failure.follow`` and ``name_the_holdup``)."""

from __future__ import annotations

import time

from ferrodist.collectives._failures import blame as _failure
from ferrodist.core import CollectiveTimeout
from ferrodist.transport._aborts import Notice


class Heard:
    """A transport as ``follow`` sees it: the notices heard on a channel."""

    def __init__(self, notices: dict[int, Notice]) -> None:
        self._notices = notices

    def notices(self, channel: int) -> dict[int, Notice]:
        return dict(self._notices)


def timeout(me: int, waited: int) -> CollectiveTimeout:
    return CollectiveTimeout(f"rank {me} waited 3 s for a message from rank {waited}", rank=me, waiting_for=(waited,))


def test_a_chain_of_timeouts_ends_at_the_silent_rank():
    heard = Heard({3: Notice(0, None, waited=2), 2: Notice(0, None, waited=1)})
    start = time.monotonic()
    assert _failure.follow(heard, 5, 4, 3) == ([3, 2], 1, "silent")  # 4 waited for 3, 3 for 2, 2 for 1
    assert time.monotonic() - start >= _failure.GRACE * 0.9  # rank 1 had the grace to answer
    error = timeout(4, 3)
    _failure.name_the_holdup(heard, 5, 4, error)
    assert error.waiting_for == (1,)
    assert error.message == (
        "rank 4 waited 3 s for a message from rank 3; rank 3 was waiting too (rank 3 for rank 2, rank 2 for "
        "rank 1); rank 1 sent no word: it never sent, or is stopped, hung or busy elsewhere; it held the others up"
    )


def test_a_chain_that_ends_at_a_rank_that_failed_by_itself_returns_at_once():
    heard = Heard({2: Notice(0, None, waited=1), 1: Notice(0, None)})
    start = time.monotonic()
    assert _failure.follow(heard, 5, 3, 2) == ([2], 1, "failed")
    assert time.monotonic() - start < _failure.GRACE / 2


def test_a_chain_that_ends_at_a_relayed_failure_leaves_the_error_alone():
    """Rank 1 was stopped by another rank's failure: that failure, not this chain, says more."""
    heard = Heard({2: Notice(0, None, waited=1), 1: Notice(0, None, between=True, relayed=True)})
    assert _failure.follow(heard, 5, 3, 2) == ([2], 1, "relayed")
    error = timeout(3, 2)
    _failure.name_the_holdup(heard, 5, 3, error)
    assert error.waiting_for == (2,) and error.message == "rank 3 waited 3 s for a message from rank 2"


def test_ranks_waiting_on_each_other_in_a_loop_are_a_deadlock():
    heard = Heard({1: Notice(0, None, waited=2), 2: Notice(0, None, waited=0)})
    assert _failure.follow(heard, 5, 0, 1) == ([1, 2], 0, "loop")
    error = timeout(0, 1)
    _failure.name_the_holdup(heard, 5, 0, error)
    assert "in a loop (0 -> 1 -> 2 -> 0)" in error.message and error.waiting_for == (1,)


def test_a_peers_timeout_that_failed_this_ranks_receive_names_what_this_rank_waited_for():
    """Rank 3 timed out waiting for rank 2 (healthy, waiting for rank 1) and its abort failed
    rank 0's receive from rank 1: rank 0's error (rank 3's) must not name rank 2."""
    relayed = timeout(3, 2).with_context("rank 0: receive from rank 1")
    relayed.aborted_by, relayed.awaited = 3, 1
    heard = Heard({3: Notice(0, None, waited=2), 2: Notice(0, None, waited=1)})
    _failure.name_the_holdup(heard, 5, 0, relayed)
    assert relayed.waiting_for == (1,)
    assert relayed.message.endswith(
        "; this rank was waiting for rank 1, and rank 1 sent no word: it never sent, or is stopped, hung or busy "
        "elsewhere; it held the others up"
    )


def test_nothing_to_add_when_the_peer_waited_for_is_the_end():
    for heard in (Heard({}), Heard({1: Notice(0, None)})):  # silent, or it failed by itself
        error = timeout(0, 1)
        _failure.name_the_holdup(heard, 5, 0, error)
        assert error.message == "rank 0 waited 3 s for a message from rank 1" and error.waiting_for == (1,)


def test_a_rank_whose_receive_was_stopped_by_another_failure_passes_its_wait_on():
    """Rank 2's receive from rank 1 was failed by rank 0's timeout: its notice still says it
    was waiting for rank 1, so rank 3 (which waited for rank 2) reaches rank 1."""
    heard = Heard({2: Notice(0, None, waited=1, relayed=True), 0: Notice(0, None, waited=1)})
    error = timeout(3, 2)
    _failure.name_the_holdup(heard, 5, 3, error)
    assert error.waiting_for == (1,) and "(rank 2 for rank 1); rank 1 sent no word" in error.message


class HeardAndGone(Heard):
    """A transport as the census sees it: notices, and the peers whose connection ended."""

    def __init__(self, notices: dict[int, Notice], gone: set[int]) -> None:
        super().__init__(notices)
        self._gone = frozenset(gone)

    def gone(self) -> frozenset[int]:
        return self._gone


def test_the_census_names_a_rank_that_left_before_a_slow_one():
    """On a crowded machine a healthy rank may answer after the grace; a rank whose connection
    ended is the one to blame, and alone (it once was blamed together with the slow one, in
    rank order, so the slow rank came first)."""
    transport = HeardAndGone({2: Notice(7, None)}, gone={3})
    clause, blamed = _failure.census(transport, 5, 0, [0, 1, 2, 3], 7)
    assert blamed == [3]
    assert clause.startswith(
        "rank 3 left the job: its connection ended (exited, crashed or killed); no word yet from rank 1"
    )
    clause, blamed = _failure.census(HeardAndGone({}, gone=set()), 5, 0, [0, 1, 2], 7)
    assert blamed == [1, 2] and clause.startswith("no word from ranks [1, 2]: they never reached call #7")
