"""Starting a job through a key-value store it already has (``rendezvous=``), ranks as
threads: rank 0 hosts ferrodist's store on a port the OS picks and publishes it there.

(tests/torch/ does the same through torch's TCPStore, in real processes under torchrun.)
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from ferrodist.core import AuthenticationFailed, CollectiveTimeout, FerrodistError, InvalidArgument
from ferrodist.transport import KeyValue, ShmTransport, TcpTransport
from ferrodist.transport._start import auth
from ferrodist.transport._start.rendezvous import STORE_KEY


class DictStore:
    """The smallest ``KeyValue``: a dict whose ``get`` blocks until the key is set."""

    def __init__(self, *, timeout: float = 30.0) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.timeout = timeout

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = bytes(value)
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, self.timeout):
                raise RuntimeError(f"wait timeout after {self.timeout} s for key {key}")
            return self.data[key]


def connect_all(kv, world_size, *, kind=TcpTransport, timeout=30.0, tokens=None):
    results: dict[int, object] = {}

    def join(rank: int) -> None:
        try:
            results[rank] = kind.connect(
                rank=rank,
                world_size=world_size,
                rendezvous=kv,
                timeout=timeout,
                token=None if tokens is None else tokens[rank],
            )
        except FerrodistError as exc:
            results[rank] = exc

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return [results[r] for r in range(world_size)]


def exchange_ring(transports) -> None:
    """Each rank sends its rank to the next one; every value must arrive."""
    n = len(transports)
    got = [np.zeros(1, np.int64) for _ in range(n)]
    requests = [t.irecv(got[t.rank], (t.rank - 1) % n, 7) for t in transports]
    for t in transports:
        t.send(np.array([t.rank], np.int64), (t.rank + 1) % n, 7)
    for request in requests:
        request.wait(10)
    assert [int(g[0]) for g in got] == [(r - 1) % n for r in range(n)]


def test_a_dict_store_is_a_key_value_store():
    assert isinstance(DictStore(), KeyValue)
    assert not isinstance(object(), KeyValue)


@pytest.mark.parametrize("kind", [TcpTransport, ShmTransport])
def test_a_job_starts_through_an_outside_store_without_any_port(kind, monkeypatch, caplog):
    """Without FERRODIST_TOKEN no secret goes into the store (torch's lets anyone who reaches
    its port read it): the job is open, and rank 0 says so once, with how to close it."""
    monkeypatch.delenv("FERRODIST_TOKEN", raising=False)
    monkeypatch.setattr(auth, "_OPEN", {"said": False, "left": False})
    kv = DictStore()
    with caplog.at_level(logging.WARNING, logger="ferrodist.transport"):
        transports = connect_all(kv, 3, kind=kind)
    try:
        assert all(isinstance(t, kind) for t in transports), transports
        exchange_ring(transports)
        address, store_id, secret = kv.data[STORE_KEY].decode().split(" ")
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0 and store_id == transports[1].store.store_id
        assert secret == "-"  # nothing a stranger could read and use
        said = [r.getMessage() for r in caplog.records if r.name == "ferrodist.transport"]
        assert len(said) == 1, said
        assert "not authenticated" in said[0] and "MASTER_PORT" in said[0] and "FERRODIST_TOKEN=$(python" in said[0]
    finally:
        for t in transports:
            if not isinstance(t, FerrodistError):
                t.close()


def test_a_given_token_is_not_published_and_a_wrong_one_is_refused():
    kv = DictStore()
    transports = connect_all(kv, 2, tokens=[b"job", b"job"])
    try:
        assert kv.data[STORE_KEY].decode().endswith(" -")
        exchange_ring(transports)
    finally:
        for t in transports:
            t.close()
    # as through MASTER_PORT: the rank without the job's token is refused, the others name it
    results = connect_all(DictStore(), 2, tokens=[b"job", b"other"], timeout=2)
    assert isinstance(results[1], AuthenticationFailed) and "FERRODIST_TOKEN" in str(results[1])
    assert isinstance(results[0], CollectiveTimeout) and results[0].waiting_for == (1,)


def test_a_missing_rank_0_is_named_within_the_deadline():
    kv = DictStore(timeout=60)
    begin = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="rank 0") as info:
        TcpTransport.connect(rank=1, world_size=2, rendezvous=kv, timeout=1.5)
    assert time.monotonic() - begin < 3
    assert info.value.waiting_for == (0,)


def test_the_store_s_own_timeout_is_reported_as_rank_0_missing():
    kv = DictStore(timeout=0.3)
    with pytest.raises(CollectiveTimeout, match="own timeout"):
        TcpTransport.connect(rank=1, world_size=2, rendezvous=kv, timeout=10)


def test_a_second_group_through_the_same_store_ignores_the_first_one_s_record():
    """The record of a group that was closed stays in the store; the ranks of the next
    group must wait for rank 0's new one instead of dialing the old store."""
    kv = DictStore()
    for _ in range(3):
        transports = connect_all(kv, 2)
        assert all(isinstance(t, TcpTransport) for t in transports), transports
        exchange_ring(transports)
        for t in transports:
            t.close()
    # rank 1 starts long before rank 0: it must not take the closed group's store for the new one
    results: dict[int, object] = {}
    late = threading.Thread(
        target=lambda: (
            time.sleep(1.0),
            results.__setitem__(0, TcpTransport.connect(rank=0, world_size=2, rendezvous=kv, timeout=20)),
        )
    )
    late.start()
    results[1] = TcpTransport.connect(rank=1, world_size=2, rendezvous=kv, timeout=20)
    late.join(30)
    transports = [results[0], results[1]]
    try:
        exchange_ring(transports)
    finally:
        for t in transports:
            t.close()


def test_neither_way_to_start_is_a_clear_error():
    with pytest.raises(InvalidArgument, match=r"master_addr= and master_port=.*rendezvous="):
        TcpTransport.connect(rank=0, world_size=1, timeout=1)
    with pytest.raises(InvalidArgument, match=r"get\(key\) and set"):
        TcpTransport.connect(rank=0, world_size=1, rendezvous=object(), timeout=1)  # type: ignore[arg-type]
