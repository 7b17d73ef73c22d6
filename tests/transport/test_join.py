"""A replacement for a lost rank joins a running TCP job (``TcpTransport.join`` and
``admit``), in threads of this process: the live ranks take it in the lost rank's place,
messages flow both ways, a process without the job's token is refused, and only a lost
rank can be replaced."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _helpers import tcp_world
from ferrodist.core import AuthenticationFailed, BackendUnavailable, InvalidArgument, PeerLost
from ferrodist.transport import SimulatedTransport, TcpTransport

pytestmark = pytest.mark.timeout(60)
TOKEN = b"test-token"


def _lose(world: list, rank: int) -> None:
    """Close ``rank`` (as a killed process's connections end) and wait until the others know."""
    world[rank].close()
    for t in world:
        if t is not world[rank]:
            for _ in range(500):
                if rank in t.gone():
                    break
                threading.Event().wait(0.01)


def _replacement(rank: int, size: int, token: bytes = TOKEN):
    """Start a replacement of ``rank`` in a thread; returns (address box, result box, thread,
    members box: append the group's members to let it finish)."""
    address: list[str] = []
    result: list = []
    known: list[list[int]] = []

    def run() -> None:
        try:
            result.append(
                TcpTransport.join(
                    rank=rank,
                    world_size=size,
                    announce=address.append,
                    members=lambda: known[0] if known else None,
                    timeout=10,
                    token=token,
                    start_timeout=10,
                )
            )
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    for _ in range(500):
        if address:
            break
        threading.Event().wait(0.01)
    return address, result, thread, known


def test_a_replacement_takes_the_lost_ranks_place_and_messages_flow_both_ways():
    world = tcp_world(3, timeout=10)
    try:
        _lose(world, 2)
        address, result, thread, known = _replacement(2, 3)
        known.append([0, 1, 2])
        for t in world[:2]:
            t.admit(2, address[0], timeout=10)
        thread.join(20)
        joined, members = result[0]
        assert members == (0, 1, 2) and 2 not in world[0].gone() and 2 not in world[1].gone()
        for src in (0, 1):
            world[src].send(np.full(4, float(src + 1)), 2, tag=7)
            got = np.zeros(4)
            joined.recv(got, src, tag=7)
            assert got[0] == src + 1
            joined.send(np.full(3, 9.0), src, tag=8)
            back = np.zeros(3)
            world[src].recv(back, 2, tag=8)
            assert back[0] == 9.0
        joined.close()
    finally:
        for t in world:
            t.close()


def test_only_a_lost_rank_is_replaced_and_a_process_without_the_token_is_refused():
    world = tcp_world(3, timeout=10)
    try:
        with pytest.raises(InvalidArgument, match="not a lost rank"):
            world[0].admit(1, "127.0.0.1:1", timeout=1)
        _lose(world, 2)
        address, result, thread, known = _replacement(2, 3, token=b"another-token")
        with pytest.raises((AuthenticationFailed, PeerLost)):
            world[0].admit(2, address[0], timeout=3)
        assert 2 in world[0].gone()  # still lost: nothing replaced it
        known.append([0, 1, 2])
        thread.join(20)
        assert isinstance(result[0], Exception)  # it never got its members' connections
    finally:
        for t in world:
            t.close()


def test_a_simulated_world_cannot_take_a_new_process():
    t = SimulatedTransport.create_group(2)
    with pytest.raises(BackendUnavailable, match="cannot take in a new process"):
        t[0].admit(1, "127.0.0.1:1")
