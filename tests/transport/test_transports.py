"""Every transport (simulated, and TCP between threads of this process) against the same
contract: matching by source and tag, sizes and fingerprints, errors, timeouts, closing."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from _helpers import tcp_world
from ferrodist.core import CollectiveMismatch, CollectiveTimeout, InvalidArgument, InvalidRank, PeerLost
from ferrodist.transport import Faults, Request, SimulatedTransport, TcpTransport, Transport


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


def test_every_transport_says_its_kind_and_takes_the_ranks_on_its_host():
    """``kind`` is the name init_process_group knows each by (ShmTransport is a
    TcpTransport: its own kind wins), and ``share_host`` is on every one of them."""
    from ferrodist.transport import MpiTransport, ShmTransport

    kinds = {SimulatedTransport: "simulated", TcpTransport: "tcp", ShmTransport: "shm", MpiTransport: "mpi"}
    for cls, kind in kinds.items():
        assert cls.kind == kind and callable(cls.share_host), cls
    t0, t1 = SimulatedTransport.create_group(2)
    try:
        t0.share_host(8)  # nothing to tune: the ranks are threads
        assert isinstance(t0, Transport) and t0.kind == "simulated"
    finally:
        t0.close()
        t1.close()


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


# -- receiving from any of several senders -----------------------------------------------------------
def test_a_receive_from_any_takes_the_message_that_came_first_and_says_whose(make_world):
    t0, t1, t2, t3 = make_world(4)
    t3.send(np.array([3.0]), 0, tag=5)
    time.sleep(0.05)  # over TCP: let rank 3's message arrive before rank 1's
    t1.send(np.array([1.0]), 0, tag=5)
    t2.send(np.array([2.0]), 0, tag=6)  # another tag: not for these receives
    time.sleep(0.05)
    got = []
    for _ in range(2):
        out = np.zeros(1)
        request = t0.irecv_any(out, [1, 2, 3], tag=5)
        request.wait(2)
        got.append((request.source, out[0]))
    assert got == [(3, 3.0), (1, 1.0)]
    out = np.zeros(1)
    t0.recv(out, 2, tag=6, timeout=2)
    assert out[0] == 2.0


def test_a_message_goes_to_whichever_receive_was_posted_first(make_world):
    t0, t1, t2 = make_world(3)
    first_any, named, second_any = np.zeros(1), np.zeros(1), np.zeros(1)
    r_any = t0.irecv_any(first_any, [1, 2], tag=1)
    r_named = t0.irecv(named, 2, tag=1)
    r_any2 = t0.irecv_any(second_any, [1, 2], tag=1)
    assert r_any.source is None and not r_any.is_completed()
    t2.send(np.array([20.0]), 0, tag=1)  # the first receive posted that takes rank 2's message
    r_any.wait(2)
    t2.send(np.array([21.0]), 0, tag=1)  # then the receive that names rank 2
    r_named.wait(2)
    t1.send(np.array([10.0]), 0, tag=1)
    r_any2.wait(2)
    assert (r_any.source, first_any[0], named[0], r_any2.source, second_any[0]) == (2, 20.0, 21.0, 1, 10.0)


def test_receives_from_any_take_every_message_once_and_each_senders_in_order(make_world):
    world = make_world(4)
    per_sender = 25

    def sender(rank):
        for i in range(per_sender):
            world[rank].send(np.array([rank, i], np.int64), 0, tag=9)

    threads = [threading.Thread(target=sender, args=(r,)) for r in (1, 2, 3)]
    for thread in threads:
        thread.start()
    seen: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for _ in range(3 * per_sender):
        out = np.full(2, -1, np.int64)
        request = world[0].irecv_any(out, [1, 2, 3], tag=9)
        request.wait(10)
        assert out[0] == request.source
        seen[request.source].append(int(out[1]))
    for thread in threads:
        thread.join(10)
    assert seen == {r: list(range(per_sender)) for r in (1, 2, 3)}


def test_a_large_message_from_any_sender_arrives_intact(make_world):
    t0, t1, t2 = make_world(3)
    big = np.arange(3 << 20, dtype=np.uint8)  # arrives in pieces over TCP
    out = np.zeros_like(big)
    request = t0.irecv_any(out, [1, 2], tag=2)
    t2.send(big, 0, tag=2)
    request.wait(10)
    assert request.source == 2 and np.array_equal(out, big)
    t1.send(big[::-1].copy(), 0, tag=2)
    time.sleep(0.05)
    request = t0.irecv_any(out, [1, 2], tag=2)  # posted while (or after) it arrives
    request.wait(10)
    assert request.source == 1 and np.array_equal(out, big[::-1])


def test_a_receive_from_any_times_out_naming_every_sender_and_swallows_nothing_late(make_world):
    t0, _, t2 = make_world(3)
    with pytest.raises(CollectiveTimeout, match=r"any of ranks \[1, 2\]") as info:
        t0.irecv_any(np.zeros(1), [1, 2], tag=4).wait(0.2)
    assert info.value.waiting_for == (1, 2)
    t2.send(np.array([7.0]), 0, tag=4)
    out = np.zeros(1)
    t0.recv(out, 2, tag=4, timeout=2)
    assert out[0] == 7.0


def test_a_receive_from_any_checks_sizes_and_fingerprints(make_world):
    t0, t1, _ = make_world(3)
    t1.send(np.zeros(3), 0, tag=1)
    with pytest.raises(CollectiveMismatch, match="from rank 1"):
        t0.irecv_any(np.zeros(2), [1, 2], tag=1).wait(2)
    t1.send(np.zeros(2), 0, tag=2, fingerprint=5)
    with pytest.raises(CollectiveMismatch):
        t0.irecv_any(np.zeros(2), [1, 2], tag=2, fingerprint=6).wait(2)


def test_a_receive_from_any_waits_on_for_the_senders_that_have_not_finished(make_world):
    """A work queue's workers leave when they are done: the others may still send."""
    t0, t1, t2 = make_world(3)
    out = np.zeros(1)
    request = t0.irecv_any(out, [1, 2], tag=3)
    t2.close()
    time.sleep(0.1)
    assert not request.is_completed()
    t1.send(np.array([1.0]), 0, tag=3)
    request.wait(5)
    assert (request.source, out[0]) == (1, 1.0)
    request = t0.irecv_any(out, [1, 2], tag=3)
    start = time.monotonic()
    t1.close()
    with pytest.raises(PeerLost, match="closed its transport") as info:  # every sender has left
        request.wait(30)
    assert time.monotonic() - start < 5
    assert info.value.peer in (1, 2)


def test_a_sender_that_fails_ends_a_receive_from_any_at_once(make_world, request):
    if request.node.callspec.params["make_world"] == "simulated":
        world = SimulatedTransport.create_group(3, faults=Faults(die_at={2: 1}))
    else:
        world = make_world(3)
    t0, _, t2 = world
    receive = t0.irecv_any(np.zeros(1), [1, 2], tag=3)
    time.sleep(0.05)
    start = time.monotonic()
    if isinstance(t2, SimulatedTransport):
        with pytest.raises(PeerLost):
            t2.send(np.zeros(1), 0, tag=3)  # its first message: it dies
    else:
        t2._links[0].sock.shutdown(socket.SHUT_RDWR)  # gone without a goodbye, as a killed process is
    with pytest.raises(PeerLost) as info:
        receive.wait(30)
    assert time.monotonic() - start < 5
    assert info.value.peer == 2 and not info.value.finished
    for t in world:
        t.close()


@pytest.mark.parametrize("sources", [[], [0, 1], [1, 1], [1, 5]])
def test_bad_sender_lists_are_refused(make_world, sources):
    t0, _, _ = make_world(3)
    with pytest.raises((InvalidArgument, InvalidRank)):
        t0.irecv_any(np.zeros(1), sources, tag=0)
