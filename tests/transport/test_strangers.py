"""Processes that are not of the job, ranks as threads of this process: connections to a
starting job's ports that stay silent, speak something else or lack the token; frame
headers and store records that announce more than their receiver expects; and the secret
a job derives from its launcher when ``FERRODIST_TOKEN`` is not set.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import sys
import threading
import time
import tracemalloc
import types
from pathlib import Path

import numpy as np
import pytest

from _helpers import free_port, tcp_world
from ferrodist.core import (
    AuthenticationFailed,
    CollectiveMismatch,
    CollectiveTimeout,
    FerrodistError,
    InvalidArgument,
    ProtocolError,
)
from ferrodist.transport import ShmTransport, StoreClient, TcpTransport
from ferrodist.transport._frames import ABORT, DATA, GOODBYE, encode_header
from ferrodist.transport._start.auth import accept_handshake, connect_handshake
from ferrodist.transport._start.net import connect_with_retry

TOKEN = b"strangers-test"
MiB = 1 << 20


def this_hosts_address() -> str:
    """An address of this host that is not loopback (the one that routes outwards)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent
        address = str(probe.getsockname()[0])
    except OSError:
        address = "127.0.0.1"
    finally:
        probe.close()
    if address.startswith("127."):
        pytest.skip("this host has no address other than loopback")
    return address


@pytest.fixture
def no_launcher(monkeypatch):
    """An environment in which no launcher gave this process a place or a secret."""
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "FERRODIST_TOKEN") or name.startswith(
            ("SLURM_", "OMPI_", "PMI", "TORCHELASTIC_")
        ):
            monkeypatch.delenv(name)


def in_thread(fn, *args, **kwargs):
    """Run ``fn`` in a thread; returns (thread, box) where box[0] is its result or error."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn(*args, **kwargs))
        except FerrodistError as exc:
            box.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def silent_connections(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` connections to ``host:port`` that never send a byte."""
    return [socket.create_connection((host, port), timeout=5) for _ in range(count)]


def address_of(port: int, rank: int) -> tuple[str, int]:
    """Where ``rank`` of the job whose store is on ``port`` listens (read with the token)."""
    store = StoreClient("127.0.0.1", port, timeout=10, token=TOKEN)
    try:
        host, _, peer_port = store.get(f"ferrodist/addr/{rank}", timeout=10).decode().rpartition(":")
    finally:
        store.close()
    return host, int(peer_port)


# -- connections that are not of the job, during the start ------------------------------------


def test_silent_connections_do_not_hold_up_the_start():
    """Each silent connection may keep its handshake open for HANDSHAKE_LIMIT (5 s). Taken one
    after the other, the 8 opened to rank 0's port would hold its start for 40 s, past the 20 s
    the start is given: rank 1 gets in only if every handshake runs on its own."""
    port = free_port()
    thread, box = in_thread(
        TcpTransport.connect, rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=20, token=TOKEN
    )
    host, rank0_port = address_of(port, 0)
    strangers = silent_connections(host, rank0_port, 8) + silent_connections("127.0.0.1", port, 4)
    try:
        t1 = TcpTransport.connect(
            rank=1, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=20, token=TOKEN
        )
        thread.join(25)
        t0 = box[0]
        assert isinstance(t0, TcpTransport), t0
        try:
            other, _ = in_thread(t1.barrier, timeout=10)
            t0.barrier(timeout=10)
            other.join(15)
            # rank 0 took rank 1 in while every silent connection was still in its handshake
            assert t0._refusals.pending_at_end == 8
        finally:
            t1.close()
            t0.close()
    finally:
        for sock in strangers:
            sock.close()


def test_a_start_that_fails_says_which_connections_it_refused_and_from_where():
    port = free_port()
    thread, box = in_thread(
        TcpTransport.connect, rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=4, token=TOKEN
    )
    host, rank0_port = address_of(port, 0)
    strangers = silent_connections(host, rank0_port, 1)
    garbage = socket.create_connection((host, rank0_port), timeout=5)
    garbage.sendall(b"GET / HTTP/1.0\r\n\r\n" * 4)
    strangers.append(garbage)
    wrong = connect_with_retry(host, rank0_port, time.monotonic() + 5, "stranger", 0)
    strangers.append(wrong)
    with pytest.raises(AuthenticationFailed):
        connect_handshake(wrong, b"not the token", time.monotonic() + 5, "stranger", 0)
    with pytest.raises(AuthenticationFailed):
        StoreClient("127.0.0.1", port, timeout=5, token=b"not the token")
    try:
        thread.join(10)
        error = box[0]
        assert isinstance(error, CollectiveTimeout), error
        message = str(error)
        assert "ranks [1] never connected to rank 0" in message
        assert "refused 3 connections" in message and "from 127.0.0.1" in message, message
        assert "2 without this job's token" in message and "1 that does not speak ferrodist" in message, message
        assert "1 more from 127.0.0.1 was still silent" in message, message
        assert "FERRODIST_TOKEN" in message
    finally:
        for sock in strangers:
            sock.close()


# -- lengths from the wire ----------------------------------------------------------------------


def forge(transport: TcpTransport, peer: int, kind: int, tag: int, length: int) -> None:
    """Send a frame header announcing ``length`` bytes, and none of them."""
    link = transport._links[peer]
    with link.framing.send_lock:
        header = encode_header(kind, tag, link.framing.send_seq, 0, length)
        link.framing.send_seq += 1
        link.sock.sendall(header)


def wait_until(condition, seconds: float = 5.0) -> None:
    give_up = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < give_up, "condition not met in time"
        time.sleep(0.01)


def test_a_header_announcing_a_gigabyte_reserves_nothing_before_its_bytes_come():
    t0, t1 = tcp_world(2, token=TOKEN)
    tracemalloc.start()
    try:
        forge(t1, 0, DATA, 5, 1 << 30)
        wait_until(lambda: t0._links[1].framing.frame is not None)  # its header is read: nobody waits for it yet
        with pytest.raises(CollectiveMismatch, match=r"expected 32 bytes from rank 1 .* sent 1073741824") as info:
            t0.recv(np.zeros(4), 1, tag=5, timeout=5)
        assert info.value.peer == 1
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 16 * MiB, f"{peak / MiB:.0f} MiB allocated for a frame whose bytes never came"
    finally:
        tracemalloc.stop()
        t0.close()
        t1.close()


def test_a_message_that_comes_before_its_receive_arrives_whole_in_pieces():
    t0, t1 = tcp_world(2, token=TOKEN)
    try:
        data = np.random.default_rng(1).random(5 * MiB // 8 + 3)  # a little over 5 MiB
        t1.send(data, 0, tag=9)
        time.sleep(0.5)  # the link's thread reads it before the receive is posted
        got = np.zeros_like(data)
        t0.recv(got, 1, tag=9, timeout=10)
        np.testing.assert_array_equal(got, data)
    finally:
        t0.close()
        t1.close()


@pytest.mark.parametrize("kind", [ABORT, GOODBYE], ids=["abort-notice", "goodbye"])
def test_a_notice_longer_than_any_notice_is_a_protocol_error_naming_the_peer(kind):
    t0, t1 = tcp_world(2, token=TOKEN)
    tracemalloc.start()
    try:
        forge(t1, 0, kind, 0, 1 << 30)
        with pytest.raises(ProtocolError, match=r"rank 1 announced .*1073741824.*longer than any") as info:
            t0.recv(np.zeros(4), 1, tag=7, timeout=5)
        assert "rank 0" in str(info.value)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 16 * MiB, f"{peak / MiB:.0f} MiB allocated for a notice whose bytes never came"
    finally:
        tracemalloc.stop()
        t0.close()
        t1.close()


def fake_store(answer: bytes) -> tuple[socket.socket, list[socket.socket]]:
    """A listener that passes the handshake, reads one request and sends ``answer``, then
    nothing (the connection stays open)."""
    listener = socket.create_server(("127.0.0.1", 0))
    kept: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            kept.append(sock)
            try:
                accept_handshake(sock, TOKEN, time.monotonic() + 5, "fake store")
                sock.recv(1024)
                sock.sendall(answer)
            except (OSError, FerrodistError):
                pass

    threading.Thread(target=serve, daemon=True).start()
    return listener, kept


def test_a_store_answer_is_read_as_it_arrives_not_reserved_from_its_length():
    listener, kept = fake_store(struct.pack("<BQ", 0, 60 * MiB))  # OK, 60 MiB to follow
    tracemalloc.start()
    try:
        with pytest.raises(CollectiveTimeout, match="did not answer"):
            StoreClient("127.0.0.1", listener.getsockname()[1], timeout=1.5, token=TOKEN)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 8 * MiB, f"{peak / MiB:.0f} MiB allocated for an answer whose bytes never came"
    finally:
        tracemalloc.stop()
        listener.close()
        for sock in kept:
            sock.close()


def test_a_store_answer_over_the_bound_is_a_protocol_error_naming_the_store():
    listener, kept = fake_store(struct.pack("<BQ", 0, 1 << 40))
    try:
        with pytest.raises(ProtocolError, match=r"store .*rank 0.* announced a record of 1099511627776 bytes"):
            StoreClient("127.0.0.1", listener.getsockname()[1], timeout=3, token=TOKEN)
    finally:
        listener.close()
        for sock in kept:
            sock.close()


# -- the job's secret, and where its ports listen --------------------------------------------------


def stranger_reads_the_store(host: str, port: int) -> object:
    """A process without any token asks the store for rank 0's address: the value, or the error."""
    try:
        store = StoreClient(host, port, timeout=5, token=b"")
    except (FerrodistError, OSError) as exc:
        return exc
    try:
        return store.get("ferrodist/addr/0", timeout=5)
    finally:
        store.close()


def connect_pair(kind, port, master, **options):
    """Ranks 0 and 1 of ``kind`` connected from two threads, without a token given."""
    threads = [
        in_thread(kind.connect, rank=r, world_size=2, master_addr=master, master_port=port, timeout=30, **options)
        for r in (0, 1)
    ]
    results = []
    for thread, box in threads:
        thread.join(40)
        results.append(box[0])
    return results


class DictStore:
    """A key-value store the job already has (as torch's is under torchrun): ``get`` blocks."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = bytes(value)
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, 30):
                raise RuntimeError(f"timeout waiting for {key}")
            return self.data[key]


@pytest.mark.parametrize("token", [None, b"the job's"])
def test_through_the_launcher_s_store_only_a_token_keeps_strangers_out(no_launcher, token):
    """Under torchrun ranks start through torch's store, which anyone who reaches its port can
    read: no secret is kept there. With FERRODIST_TOKEN (``token``) a stranger that reaches rank
    0's store is refused; without it the job is open, as rank 0 says at start
    (test_external_store), and the stranger reads the store."""
    host = this_hosts_address()
    kv = DictStore()
    boxes = [
        in_thread(TcpTransport.connect, rank=r, world_size=2, rendezvous=kv, master_addr=host, token=token)
        for r in (0, 1)
    ]
    for thread, _ in boxes:
        thread.join(40)
    t0, t1 = (box[0] for _, box in boxes)
    try:
        assert isinstance(t0, TcpTransport) and isinstance(t1, TcpTransport), (t0, t1)
        assert t0._server is not None and t0._server.address == host  # not every address of the host
        assert not [value for value in kv.data.values() if token and token in value]  # the token is not there
        outcome = stranger_reads_the_store(host, t0._server.port)
        if token:
            assert isinstance(outcome, AuthenticationFailed), outcome
        else:
            assert isinstance(outcome, bytes) and outcome, outcome
    finally:
        for t in (t0, t1):
            if isinstance(t, TcpTransport):
                t.close()


def test_under_slurm_without_a_token_the_job_derives_a_secret_and_refuses_strangers(no_launcher, monkeypatch, tmp_path):
    host = this_hosts_address()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("FERRODIST_SECRET_FILE", str(tmp_path / "ferrodist" / "secret"))
    port = free_port()
    t0, t1 = connect_pair(TcpTransport, port, host)
    try:
        assert isinstance(t0, TcpTransport) and isinstance(t1, TcpTransport), (t0, t1)
        threads = [threading.Thread(target=t.barrier, kwargs={"timeout": 10}) for t in (t0, t1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        outcome = stranger_reads_the_store(host, port)
        assert isinstance(outcome, AuthenticationFailed), outcome
        secret = tmp_path / "ferrodist" / "secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
    finally:
        for t in (t0, t1):
            if isinstance(t, TcpTransport):
                t.close()


def test_without_a_token_or_a_launcher_secret_a_job_across_hosts_is_refused(no_launcher):
    host = this_hosts_address()
    port = free_port()
    errors = connect_pair(TcpTransport, port, host)
    for rank, error in enumerate(errors):
        assert isinstance(error, InvalidArgument), error
        message = str(error)
        assert message.startswith(f"rank {rank}:"), message
        assert "FERRODIST_TOKEN" in message and f"MASTER_ADDR={host}" in message, message
    with pytest.raises(OSError):  # nothing was opened
        socket.create_connection((host, port), timeout=2).close()


def test_without_a_token_a_job_on_one_host_listens_on_loopback_only(no_launcher):
    host = this_hosts_address()
    port = free_port()
    t0, t1 = connect_pair(ShmTransport, port, host)
    try:
        assert isinstance(t0, ShmTransport) and isinstance(t1, ShmTransport), (t0, t1)
        with pytest.raises(OSError):  # the store is not on the host's outward address
            socket.create_connection((host, port), timeout=2).close()
        for t in (t0, t1):
            for link in t._links.values():
                assert link.sock.getsockname()[0] == "127.0.0.1"
    finally:
        for t in (t0, t1):
            if isinstance(t, TcpTransport):
                t.close()


def test_the_store_listens_on_the_address_the_job_uses_not_on_every_address(no_launcher):
    host = this_hosts_address()
    port = free_port()
    t0, t1 = connect_pair(TcpTransport, port, host, token=TOKEN)
    try:
        assert isinstance(t0, TcpTransport) and isinstance(t1, TcpTransport), (t0, t1)
        assert t0._server is not None
        assert t0._server._listener.getsockname()[0] == host
    finally:
        for t in (t0, t1):
            if isinstance(t, TcpTransport):
                t.close()


class FakeComm:
    """COMM_WORLD of a fake mpi4py: rank ``rank`` of ``size``; ``Ibcast`` fills the buffer with
    what rank 0 sent (rank 0 calls first here) and completes at once."""

    def __init__(self, rank: int, size: int, sent: list[bytes]) -> None:
        self.rank, self.size, self.sent = rank, size, sent

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Ibcast(self, spec: list[object], root: int = 0) -> object:
        buffer = spec[0]
        assert isinstance(buffer, bytearray)
        if self.rank == root:
            self.sent.append(bytes(buffer))
        else:
            buffer[:] = self.sent[0]
        return types.SimpleNamespace(Test=lambda: True)


def test_under_mpiexec_with_mpi4py_rank_0_broadcasts_a_secret(monkeypatch):
    from ferrodist.transport._start.auth import launcher_secret

    sent: list[bytes] = []
    secrets_of = []
    for rank in (0, 1):
        mpi = types.ModuleType("mpi4py.MPI")
        mpi.COMM_WORLD = FakeComm(rank, 2, sent)  # type: ignore[attr-defined]
        mpi.BYTE = "BYTE"  # type: ignore[attr-defined]
        package = types.ModuleType("mpi4py")
        package.MPI = mpi  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "mpi4py", package)
        monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
        env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2"}
        secrets_of.append(launcher_secret(rank, 2, env))
    assert secrets_of[0].key == secrets_of[1].key and len(secrets_of[0].key) == 64
    assert "MPI" in secrets_of[0].source
    # a COMM_WORLD that is not the job's (another MPI library, a singleton) gives nothing
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = FakeComm(0, 1, [])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    assert launcher_secret(0, 2, {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}).key == b""


def test_slurm_secrets_differ_between_jobs_and_the_file_is_made_once(tmp_path):
    from ferrodist.transport._start.auth import launcher_secret

    env = {"SLURM_JOB_ID": "7", "FERRODIST_SECRET_FILE": str(tmp_path / "s" / "secret")}
    first = launcher_secret(0, 2, env)
    assert first.key and "SLURM_JOB_ID" in first.source
    content = Path(env["FERRODIST_SECRET_FILE"]).read_bytes()
    assert launcher_secret(1, 2, env).key == first.key
    assert Path(env["FERRODIST_SECRET_FILE"]).read_bytes() == content
    assert launcher_secret(0, 2, {**env, "SLURM_JOB_ID": "8"}).key != first.key
