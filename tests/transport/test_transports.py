"""Every transport (simulated, and TCP between threads of this process) against the same
contract: matching by source and tag, sizes and fingerprints, errors, timeouts, closing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from _helpers import tcp_world
from ferrodist.core import CollectiveMismatch, CollectiveTimeout, InvalidArgument, InvalidRank, PeerLost
from ferrodist.transport import Request, SimulatedTransport, TcpTransport, Transport


@pytest.fixture(params=["simulated", "tcp"])
def make_world(request):
    """make_world(n) -> n connected transports of the parametrized kind (closed afterwards)."""
    made = []

    def build(world_size):
        if request.param == "simulated":
            world = SimulatedTransport.create_group(world_size)
        else:
            world = tcp_world(world_size)
        made.extend(world)
        return world

    yield build
    for t in made:
        t.close()


def test_is_a_transport(make_world):
    t0, _ = make_world(2)
    assert isinstance(t0, Transport)
    assert (t0.rank, t0.world_size) == (0, 2)
    assert isinstance(t0.irecv(np.empty(1), 1), Request)


def test_messages_match_by_source_and_tag_in_order(make_world):
    t0, t1, t2 = make_world(3)
    t0.send(np.array([1], np.int64), dst=2, tag=5)
    t1.send(np.array([2], np.int64), dst=2, tag=5)
    t0.send(np.array([3], np.int64), dst=2, tag=6)
    t0.send(np.array([4], np.int64), dst=2, tag=5)
    out = np.empty(1, np.int64)
    got = []
    for src, tag in [(0, 6), (1, 5), (0, 5), (0, 5)]:
        t2.recv(out, src=src, tag=tag, timeout=1)
        got.append(int(out[0]))
    assert got == [3, 2, 1, 4]


def test_posted_receive_is_filled_by_a_later_send_and_in_post_order(make_world):
    t0, t1 = make_world(2)
    first, second = np.zeros(2, np.float32), np.zeros(2, np.float32)
    r1 = t1.irecv(first, 0, tag=1)
    r2 = t1.irecv(second, 0, tag=1)
    assert not r1.is_completed()
    t0.isend(np.array([1, 2], np.float32), 1, tag=1).wait(1)
    t0.send(np.array([3, 4], np.float32), 1, tag=1)
    r2.wait(1)
    r1.wait(1)
    np.testing.assert_array_equal(first, [1, 2])
    np.testing.assert_array_equal(second, [3, 4])


def test_send_copies_so_the_sender_may_reuse_its_buffer(make_world):
    t0, t1 = make_world(2)
    buf = np.array([1.0, 2.0])
    t0.send(buf, 1)
    buf[:] = -1
    out = np.empty(2)
    t1.recv(out, 0, timeout=1)
    np.testing.assert_array_equal(out, [1.0, 2.0])


def test_size_mismatch_is_reported_to_the_receiver(make_world):
    t0, t1 = make_world(2)
    t0.send(np.zeros(3, np.float32), 1)
    with pytest.raises(CollectiveMismatch, match=r"expected 8 bytes from rank 0.*sent 12"):
        t1.recv(np.zeros(2, np.float32), 0, timeout=1)


@pytest.mark.parametrize("peer", [0, 2, -1, 5])
def test_bad_peers_are_invalid_ranks(make_world, peer):
    t0, _ = make_world(2)
    with pytest.raises(InvalidRank):
        t0.send(np.zeros(1), peer)
    with pytest.raises(InvalidRank):
        t0.irecv(np.zeros(1), peer)


def test_sending_to_yourself_says_so(make_world):
    t0, _ = make_world(2)
    with pytest.raises(InvalidRank, match="names itself"):
        t0.send(np.zeros(1), 0)


@pytest.mark.parametrize("tag", [-1, 1.5, True, 1 << 64])
def test_bad_tags(make_world, tag):
    t0, _ = make_world(2)
    with pytest.raises(InvalidArgument, match="tag"):
        t0.send(np.zeros(1), 1, tag=tag)


def test_buffers_must_be_contiguous_writeable_arrays(make_world):
    t0, t1 = make_world(2)
    with pytest.raises(InvalidArgument, match="numpy array"):
        t0.send(b"abc", 1)
    with pytest.raises(InvalidArgument, match="contiguous"):
        t0.send(np.zeros((4, 4))[:, 0], 1)
    frozen = np.zeros(2)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        t1.recv(frozen, 0)


def test_receive_times_out_naming_the_silent_peer(make_world):
    _, t1 = make_world(2)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="from rank 0") as info:
        t1.recv(np.zeros(1), 0, tag=3, timeout=0.2)
    assert info.value.waiting_for == (0,)
    assert 0.15 < time.monotonic() - start < 5


def test_timed_out_receive_does_not_swallow_a_late_message(make_world):
    t0, t1 = make_world(2)
    with pytest.raises(CollectiveTimeout):
        t1.recv(np.zeros(1), 0, timeout=0.05)
    t0.send(np.array([9.0]), 1)
    out = np.zeros(1)
    t1.recv(out, 0, timeout=1)
    assert out[0] == 9.0


def test_closing_a_rank_wakes_its_peers_with_peer_lost(make_world):
    t0, t1 = make_world(2)
    errors = []

    def wait_for_rank_0():
        try:
            t1.recv(np.zeros(1), 0, timeout=30)
        except PeerLost as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait_for_rank_0)
    thread.start()
    time.sleep(0.05)
    start = time.monotonic()
    t0.close()
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - start < 2
    assert errors and errors[0].peer == 0
    with pytest.raises(PeerLost, match="rank 0 closed"):
        t1.send(np.zeros(1), 0)


def test_messages_sent_before_close_are_still_delivered(make_world):
    t0, t1 = make_world(2)
    t0.send(np.array([5.0]), 1)
    t0.close()
    out = np.zeros(1)
    t1.recv(out, 0, timeout=1)
    assert out[0] == 5.0


def test_simulated_barrier_waits_for_everyone_and_names_the_missing():
    transports = SimulatedTransport.create_group(3)
    arrived = []

    def enter(t):
        t.barrier(timeout=5)
        arrived.append(t.rank)

    threads = [threading.Thread(target=enter, args=(t,)) for t in transports]
    for th in threads:
        th.start()
    for th in threads:
        th.join(5)
    assert sorted(arrived) == [0, 1, 2]
    with pytest.raises(CollectiveTimeout, match=r"ranks \[1, 2\] never arrived") as info:
        transports[0].barrier(timeout=0.1)
    assert info.value.waiting_for == (1, 2)


def test_create_group_rejects_bad_sizes():
    with pytest.raises(InvalidArgument):
        SimulatedTransport.create_group(0)
    with pytest.raises(InvalidArgument):
        SimulatedTransport.create_group(2, timeout=0)


def test_fingerprint_mismatch_leaves_the_buffer_untouched(make_world):
    t0, t1 = make_world(2)
    t0.send(np.ones(2), 1, tag=4, fingerprint=11)
    out = np.zeros(2)
    with pytest.raises(CollectiveMismatch) as info:
        t1.recv(out, 0, tag=4, fingerprint=12, timeout=1)
    assert (info.value.peer, info.value.expected, info.value.received) == (0, 12, 11)
    np.testing.assert_array_equal(out, [0.0, 0.0])
    t0.send(np.ones(2), 1, tag=4, fingerprint=0)  # zero on either side: not checked
    t1.recv(out, 0, tag=4, fingerprint=12, timeout=1)
    np.testing.assert_array_equal(out, [1.0, 1.0])


def test_barrier_on_every_transport(make_world):
    transports = make_world(3)
    done = []

    def enter(t):
        t.barrier(timeout=10)
        done.append(t.rank)

    threads = [threading.Thread(target=enter, args=(t,)) for t in transports]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert sorted(done) == [0, 1, 2]
    with pytest.raises(CollectiveTimeout):
        transports[0].barrier(timeout=0.2)


def test_large_messages_arrive_intact_in_both_orders(make_world):
    t0, t1 = make_world(2)
    big = np.random.default_rng(0).random(3_000_000)
    early, late = np.zeros_like(big), np.zeros_like(big)
    posted = t1.irecv(early, 0, tag=1)  # posted before the send: read straight into place
    t0.send(big, 1, tag=1)
    t0.send(big[::-1].copy(), 1, tag=2)  # sent before its receive is posted
    posted.wait(10)
    t1.recv(late, 0, tag=2, timeout=10)
    np.testing.assert_array_equal(early, big)
    np.testing.assert_array_equal(late, big[::-1])


def test_tcp_rendezvous_names_a_rank_that_never_came():
    from _helpers import free_port

    port = free_port()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        TcpTransport.connect(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=0.5)
    assert info.value.waiting_for == (1,)
    assert time.monotonic() - start < 5
