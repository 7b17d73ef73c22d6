"""The rendezvous store: operations, blocking waits, authentication, deadlines, and clear failures."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from _helpers import free_port
from ferrodist.core import AuthenticationFailed, BackendUnavailable, CollectiveTimeout, InvalidArgument, PeerLost
from ferrodist.transport import StoreClient, StoreServer, TcpTransport
from ferrodist.transport._start.net import HANDSHAKE_LIMIT

TOKEN = b"job-secret"
#: How much later than its timeout a store call may return.
SLACK = 0.5


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


# -- deadlines ------------------------------------------------------------------------------------
HOST_A_STORE = (
    "import time\n"
    "from ferrodist.transport import StoreServer\n"
    "server = StoreServer('127.0.0.1', 0, token=b'job-secret')\n"
    "print(server.port, flush=True)\n"
    "time.sleep(120)\n"
)


def _until_stopped(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)


@pytest.fixture
def stopped_store():
    """A client (default timeout 1 s) of a store whose process is then stopped with SIGSTOP,
    as a rank 0 in a debugger, swapped out or frozen would be."""
    host = subprocess.Popen([sys.executable, "-c", HOST_A_STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        client = StoreClient("127.0.0.1", port, timeout=1, token=TOKEN, rank=1)
        client.set("here", b"1")
        os.kill(host.pid, signal.SIGSTOP)
        _until_stopped(host.pid)  # the signal takes effect a moment later: a request may slip in
        yield client, port
    finally:
        host.kill()
        os.kill(host.pid, signal.SIGCONT)
        host.wait()
    client.close()


STORE_CALLS = {
    "set": lambda store, **kw: store.set("k", b"v", **kw),
    "get": lambda store, **kw: store.get("here", **kw),
    "add": lambda store, **kw: store.add("n", 1, **kw),
    "wait": lambda store, **kw: store.wait(["here"], **kw),
    "check": lambda store, **kw: store.check(["here"], **kw),
    "delete": lambda store, **kw: store.delete("k", **kw),
}


def test_every_request_to_a_stopped_store_returns_within_its_timeout(stopped_store):
    client, port = stopped_store
    for name, call in STORE_CALLS.items():
        for timeout, kw in ((0.3, {"timeout": 0.3}), (1.0, {})):  # its own timeout, then the client's
            start = time.monotonic()
            with pytest.raises(CollectiveTimeout) as info:
                call(client, **kw)
            took = time.monotonic() - start
            assert took < timeout + SLACK, f"{name}(timeout={timeout}) took {took:.2f} s"
            assert f"rank 1: the store on rank 0 (127.0.0.1:{port}) did not answer within {timeout:g} s" in str(
                info.value
            )
            assert "rank 0 may be stopped or overloaded" in str(info.value)
            assert info.value.waiting_for == (0,)


def test_connecting_to_a_stopped_store_returns_within_the_timeout(stopped_store):
    _, port = stopped_store
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="did not answer within 1 s"):
        StoreClient("127.0.0.1", port, timeout=1, token=TOKEN)
    assert time.monotonic() - start < 1 + SLACK


def test_a_program_that_is_not_a_store_is_named_after_the_handshake_limit():
    """Something that accepts connections and waits for its client to speak (an HTTP
    server, say) holds the port: the handshake's own limit ends the wait, not the timeout."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(BackendUnavailable) as info:
            StoreClient("127.0.0.1", port, timeout=300, token=TOKEN, rank=1)
        assert time.monotonic() - start < HANDSHAKE_LIMIT + SLACK
    message = str(info.value)
    assert f"rank 1: the process listening on 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) is not a ferrodist store" in (
        message
    )
    assert f"sent nothing for {HANDSHAKE_LIMIT:g} s" in message and "choose a free MASTER_PORT" in message


def test_one_threads_long_wait_does_not_hold_up_another_threads_requests(store):
    _, client = store
    outcome: list[BaseException] = []

    def wait_long() -> None:
        try:
            client.get("never", timeout=1)
        except CollectiveTimeout as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=wait_long)
    waiting.start()
    time.sleep(0.1)
    start = time.monotonic()
    client.set("quick", b"1", timeout=1)
    assert client.get("quick", timeout=1) == b"1"
    assert time.monotonic() - start < 0.5
    waiting.join(5)
    assert len(outcome) == 1


def test_a_timeout_must_be_a_non_negative_number(store):
    _, client = store
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(InvalidArgument, match="timeout must be a non-negative number"):
            client.set("k", b"", timeout=bad)


def test_a_client_never_takes_answers_from_a_store_that_replaced_its_own():
    first = StoreServer("127.0.0.1", 0, token=TOKEN)
    port = first.port
    client = StoreClient("127.0.0.1", port, timeout=5, token=TOKEN, rank=1)
    assert client.store_id == first.store_id
    first.close()
    second = StoreServer("127.0.0.1", port, token=TOKEN)
    try:
        with pytest.raises(PeerLost, match="went away"):
            client.get("x", timeout=1)
        with pytest.raises(PeerLost, match="is not the one this client joined any more"):
            client.get("x", timeout=1)
    finally:
        client.close()
        second.close()


def test_a_client_told_to_refuse_a_store_waits_for_its_successor():
    first = StoreServer("127.0.0.1", 0, token=TOKEN)
    port = first.port
    servers = [first]

    def replace() -> None:
        first.close()
        servers.append(StoreServer("127.0.0.1", port, token=TOKEN))

    threading.Timer(0.5, replace).start()
    start = time.monotonic()
    client = StoreClient("127.0.0.1", port, timeout=10, token=TOKEN, refuse={first.store_id})
    try:
        assert time.monotonic() - start >= 0.4
        assert client.store_id == servers[1].store_id
        client.set("k", b"on the new one")
    finally:
        client.close()
        for server in servers:
            server.close()
    # Refusing a store that stays: a clear timeout at the deadline.
    stay = StoreServer("127.0.0.1", 0, token=TOKEN)
    try:
        with pytest.raises(CollectiveTimeout, match="process group this rank has already left"):
            StoreClient("127.0.0.1", stay.port, timeout=0.5, token=TOKEN, refuse={stay.store_id})
    finally:
        stay.close()


def test_a_store_that_closes_answers_the_requests_it_applied(store, monkeypatch):
    """Rank 0 sees another rank's ``set`` applied and closes its store before the answer
    goes out (its job was done): the setter gets its answer, not a lost store."""
    _server, client = store
    handle = StoreServer._handle
    closing: list[threading.Thread] = []

    def applied_then_closed(self, op, key, value, timeout):
        answer = handle(self, op, key, value, timeout)
        if key == "attached":
            closing.append(threading.Thread(target=self.close))
            closing[0].start()
            time.sleep(0.3)  # the close runs before this answer is sent
        return answer

    monkeypatch.setattr(StoreServer, "_handle", applied_then_closed)
    client.set("attached", b"")
    closing[0].join(5)
    assert not closing[0].is_alive()
    with pytest.raises(PeerLost):
        client.get("attached", timeout=2)  # the store is closed now


def test_a_store_whose_process_exits_answers_the_requests_it_applied():
    code = textwrap.dedent(
        """
        import sys, threading, time
        from ferrodist.transport._start.store import StoreServer
        handle = StoreServer._handle
        def slow_answer(self, op, key, value, timeout):
            answer = handle(self, op, key, value, timeout)
            if key == "last":
                applied.set()
                time.sleep(0.3)
            return answer
        StoreServer._handle = slow_answer
        applied = threading.Event()
        server = StoreServer("127.0.0.1", 0, token=b"job-secret")
        print(server.port, flush=True)
        applied.wait(30)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        client = StoreClient("127.0.0.1", port, timeout=10, token=TOKEN)
        client.set("last", b"")  # the process exits once this is applied, before the answer
        client.close()
        assert proc.wait(10) == 0
    finally:
        proc.kill()


def test_a_port_taken_between_bind_and_listen_is_port_in_use(monkeypatch):
    """Two processes bind the store's port with SO_REUSEADDR before either listens (both
    binds succeed on Linux); the other one listens first. This one must say the port is
    in use (PortInUse: rank 0 then joins the store there), not raise a bare OSError."""
    from ferrodist.transport._start import net

    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("127.0.0.1", 0))
    port = other.getsockname()[1]
    bind = socket.socket.bind

    def bind_then_the_other_listens(self, address):
        bind(self, address)
        other.listen(1)

    monkeypatch.setattr(socket.socket, "bind", bind_then_the_other_listens)
    try:
        with pytest.raises(net.PortInUse, match=f"port {port} on 127.0.0.1 is already in use"):
            net.listen("127.0.0.1", port, "rendezvous store (rank 0)")
    finally:
        other.close()
