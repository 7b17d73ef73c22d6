"""The rendezvous store: operations, blocking waits, authentication, and clear failures."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from _helpers import free_port
from ferrodist.core import AuthenticationFailed, BackendUnavailable, CollectiveTimeout, InvalidArgument, PeerLost
from ferrodist.transport import StoreClient, StoreServer, TcpTransport

TOKEN = b"job-secret"


@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", 0, token=TOKEN)
    client = StoreClient("127.0.0.1", server.port, timeout=5, token=TOKEN)
    yield server, client
    client.close()
    server.close()


def test_set_get_add_check_delete(store):
    _server, client = store
    client.set("a", b"1")
    client.set("b", "two")
    assert client.get("a", timeout=1) == b"1" and client.get("b", timeout=1) == b"two"
    assert client.add("n", 5) == 5 and client.add("n", -2) == 3
    assert client.check(["a", "b"]) and not client.check(["a", "zz"])
    assert client.delete("a") and not client.delete("a")
    client.set("big", b"x" * 100_000)
    assert len(client.get("big", timeout=1)) == 100_000


def test_get_and_wait_block_until_set_without_polling(store):
    server, client = store
    other = StoreClient("127.0.0.1", server.port, timeout=5, token=TOKEN)
    late = threading.Timer(0.2, lambda: other.set("late", b"here"))
    late.start()
    start = time.monotonic()
    assert client.get("late", timeout=5) == b"here"
    assert 0.15 < time.monotonic() - start < 3
    late.join()
    # A client is used by one thread at a time: the timer gets its own.
    third = StoreClient("127.0.0.1", server.port, timeout=5, token=TOKEN)
    k2 = threading.Timer(0.1, lambda: third.set("k2", b""))
    k2.start()
    other.set("k1", b"")
    client.wait(["k1", "k2"], timeout=5)
    k2.join()
    other.close()
    third.close()


def test_timeouts_name_the_missing_keys(store):
    _, client = store
    client.set("here", b"")
    with pytest.raises(CollectiveTimeout, match=r"keys \['gone'\] were not set"):
        client.wait(["here", "gone"], timeout=0.2)
    with pytest.raises(CollectiveTimeout, match=r"'nope' was not set within 0\.1 s"):
        client.get("nope", timeout=0.1)


def test_a_client_without_the_token_is_refused_and_others_carry_on(store):
    server, client = store
    with pytest.raises(AuthenticationFailed, match="FERRODIST_TOKEN is not the job's") as info:
        StoreClient("127.0.0.1", server.port, timeout=5, token=b"wrong")
    assert "job-secret" not in str(info.value) and "wrong" not in str(info.value)
    client.set("still", b"works")
    assert client.get("still", timeout=1) == b"works"


def test_something_that_is_not_ferrodist_is_dropped_without_harm(store):
    server, client = store
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as rogue:
        rogue.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\xff" * 200)
        rogue.settimeout(2)
        try:
            while rogue.recv(4096):
                pass
        except OSError:
            pass
    client.set("fine", b"1")
    assert client.get("fine", timeout=1) == b"1"


def test_port_in_use_names_the_port():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(BackendUnavailable, match=f"port {port} on 127.0.0.1 is already in use"):
            StoreServer("127.0.0.1", port, token=TOKEN)


def test_client_retries_until_the_server_starts():
    port = free_port()
    servers = []
    threading.Timer(0.3, lambda: servers.append(StoreServer("127.0.0.1", port, token=TOKEN))).start()
    client = StoreClient("127.0.0.1", port, timeout=10, token=TOKEN)
    client.set("x", b"1")
    client.close()
    servers[0].close()


def test_failed_connection_lists_what_was_tried():
    port = free_port()
    with pytest.raises(CollectiveTimeout, match=rf"tried 127.0.0.1:{port}: Connection refused"):
        StoreClient("127.0.0.1", port, timeout=0.3, token=TOKEN)


def test_store_going_away_is_peer_lost(store):
    server, client = store
    server.close()
    with pytest.raises(PeerLost):
        client.get("x", timeout=1)


def test_bad_keys():
    server = StoreServer("127.0.0.1", 0, token=TOKEN)
    client = StoreClient("127.0.0.1", server.port, timeout=5, token=TOKEN)
    for key in ["", "a\nb", 3]:
        with pytest.raises(InvalidArgument):
            client.set(key, b"")
    client.close()
    server.close()


def test_a_rank_without_the_token_cannot_join_the_job():
    port = free_port()
    outcome = {}

    def rank(r, token):
        try:
            TcpTransport.connect(
                rank=r, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=1.5, token=token
            ).close()
        except Exception as exc:
            outcome[r] = exc

    threads = [threading.Thread(target=rank, args=(0, TOKEN)), threading.Thread(target=rank, args=(1, b"intruder"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert isinstance(outcome[1], AuthenticationFailed)
    assert isinstance(outcome[0], CollectiveTimeout) and outcome[0].waiting_for == (1,)
