"""Aborted channels: a failure on one rank fails the channel's messages on every rank, and
only that channel's; the notices say who was alive and in which call; a rank that leaves
because of a failure names the culprit in its goodbye."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from _helpers import tcp_world
from ferrodist.core import CollectiveMismatch, CollectiveTimeout, PeerLost
from ferrodist.transport import SimulatedTransport
from ferrodist.transport._aborts import channel_of, decode_notice, encode_notice


def world(kind: str, n: int) -> list:
    return SimulatedTransport.create_group(n, timeout=10) if kind == "simulated" else tcp_world(n, timeout=10)


def tag(channel: int, low: int = 0) -> int:
    return (channel << 32) | low


def test_a_notice_carries_the_class_the_attributes_and_the_call():
    error = CollectiveTimeout("rank 0 waited for rank 2", rank=0, waiting_for=(2,))
    seq, copy = decode_notice(encode_notice(7, error, 0), rank=1, peer=0)
    assert seq == 7
    assert isinstance(copy, CollectiveTimeout) and copy.waiting_for == (2,)
    assert copy.rank == 1 and copy.aborted_by == 0 and copy.notice == "rank 0 waited for rank 2"
    assert channel_of(tag(5, 0x8000_0003) | 1 << 63) == 5  # the collectives' debug bit is not the channel's


def test_a_notice_that_is_not_json_is_a_protocol_error_not_a_crash():
    seq, error = decode_notice(b"\xff not json", rank=1, peer=0)
    assert seq == -1 and type(error).__name__ == "ProtocolError"


@pytest.mark.parametrize("kind", ["simulated", "tcp"])
def test_an_abort_fails_the_channel_on_every_rank_and_leaves_other_channels_alone(kind):
    ranks = world(kind, 3)
    try:
        waiting = np.zeros(4)
        pending = ranks[1].irecv(waiting, src=2, tag=tag(5, 1))
        other = np.zeros(4)
        elsewhere = ranks[1].irecv(other, src=2, tag=tag(6, 1))
        cause = CollectiveMismatch("rank 0 saw rank 2 in another call", rank=0, peer=2)
        started = time.monotonic()
        ranks[0].abort(5, cause, peers=[1, 2], seq=3)
        with pytest.raises(CollectiveMismatch, match="rank 0 saw rank 2 in another call") as caught:
            pending.wait(5)
        assert time.monotonic() - started < 1
        assert caught.value.peer == 2 and caught.value.aborted_by == 0
        # The channel stays aborted, on the sender too: later messages on it fail at once.
        deadline = time.monotonic() + 5
        while ranks[2].aborted(5) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # rank 2's copy of the notice is read by its link's thread
        for rank in (0, 1, 2):
            assert isinstance(ranks[rank].aborted(5), CollectiveMismatch)
        with pytest.raises(CollectiveMismatch):
            ranks[2].send(np.ones(4), dst=1, tag=tag(5, 2))
        with pytest.raises(CollectiveMismatch):
            ranks[0].recv(np.zeros(4), src=1, tag=tag(5, 2), timeout=5)
        # Another channel is untouched.
        ranks[2].send(np.arange(4.0), dst=1, tag=tag(6, 1))
        elsewhere.wait(5)
        assert other.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert ranks[1].aborted(6) is None
        # Every rank that aborts sends its notice once; each says which call it was in.
        ranks[1].abort(5, ranks[1].aborted(5), peers=[0, 2], seq=3)
        deadline = time.monotonic() + 5
        while len(ranks[2].notices(5)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {peer: notice.seq for peer, notice in ranks[2].notices(5).items()} == {0: 3, 1: 3}
    finally:
        for t in ranks:
            t.close()


def test_a_rank_leaving_after_a_failure_names_the_culprit_in_its_goodbye():
    ranks = tcp_world(3, timeout=10)
    try:
        got = []

        def wait_on_rank_1() -> None:
            try:
                ranks[0].recv(np.zeros(1), src=1, tag=tag(9), timeout=5)
            except PeerLost as exc:
                got.append(exc)

        waiter = threading.Thread(target=wait_on_rank_1)
        waiter.start()
        time.sleep(0.1)
        # Rank 1 lost rank 2 on channel 5 (not the one rank 0 waits on), then leaves.
        ranks[1].abort(5, PeerLost("rank 2 went away (killed)", peer=2, rank=1), peers=[], seq=0)
        ranks[1].close()
        waiter.join(10)
        (error,) = got
        assert error.peer == 2  # the rank that died, not the messenger
        assert "rank 1 closed its transport after a failure there: rank 2 went away" in str(error)
    finally:
        for t in ranks:
            t.close()


def test_a_send_that_breaks_reports_the_failure_the_peer_told_of_before_it_left():
    """Rank 1 aborts channel 5 because rank 2 died, tells rank 0, and leaves; rank 0 has not
    read the notice yet (its link is held) when its next send on channel 5 breaks. The send
    reads what rank 1 said last and reports rank 2's death, not a broken pipe to rank 1
    (a survivor's first error must name the culprit, not the messenger)."""
    ranks = tcp_world(3, timeout=10)
    try:
        link = ranks[0]._links[1]
        link.claim()  # the link's thread stops reading: the notice stays in the socket
        ranks[1].abort(5, PeerLost("rank 2 went away (killed)", peer=2, rank=1), peers=[0], seq=3)
        ranks[1].close()
        payload = np.zeros(1 << 20)
        with pytest.raises(PeerLost) as caught:
            for _ in range(100):  # the first sends may still land in the socket buffers
                ranks[0].send(payload, 1, tag=tag(5), timeout=5)
        link.unclaim()
        assert caught.value.peer == 2, caught.value
        assert "rank 2 went away" in str(caught.value)
    finally:
        for t in ranks:
            t.close()
