"""Starting a job, ranks as threads of this process: a start that cannot work fails on
every rank within seconds with the same reason; connecting again after closing works.

(tests/integration/test_starts.py does the same with real processes.)
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from _helpers import free_port
from ferrodist.core import BackendUnavailable, FerrodistError, InvalidArgument
from ferrodist.transport import ShmTransport, StoreClient, TcpTransport
from ferrodist.transport._frames import HELLO, encode_header
from ferrodist.transport._shm.arena import default_chunk
from ferrodist.transport._start import rendezvous
from ferrodist.transport._start.auth import connect_handshake
from ferrodist.transport._start.net import connect_with_retry
from ferrodist.transport._start.rendezvous import Rendezvous

TOKEN = b"rendezvous-test"
#: Every rank of a bad start must have failed within this many seconds (timeouts are 60 s;
#: after an abort, rank 0 keeps the store up for up to 5 s for ranks still on their way).
FAST = 7.0


def start(places, port, *, kind=TcpTransport, options=None):
    """Connect one thread per (rank, world_size), with ``options[index]`` as keywords."""
    options = options or {}
    results: dict[int, object] = {}

    def join(index: int, rank: int, world_size: int) -> None:
        try:
            results[index] = kind.connect(
                rank=rank,
                world_size=world_size,
                master_addr="127.0.0.1",
                master_port=port,
                timeout=60,
                token=TOKEN,
                **options.get(index, {}),
            )
        except FerrodistError as exc:
            results[index] = exc

    begin = time.monotonic()
    threads = [threading.Thread(target=join, args=(i, r, w)) for i, (r, w) in enumerate(places)]
    for thread in threads:
        thread.start()
    return threads, results, begin


def finish(threads, results, begin, *, close=True):
    """Every thread's transport or error, and the seconds until the last one ended."""
    for thread in threads:
        thread.join(70)
    took = time.monotonic() - begin
    for value in results.values():
        if close and not isinstance(value, FerrodistError):
            value.close()
    return [results[i] for i in range(len(threads))], took


def intruder_hello(port: int, peer: int, rank: int, world_size: int) -> None:
    """A process that holds the token but skips the registration: it dials ``peer`` and
    says it is ``rank`` of ``world_size``."""
    store = StoreClient("127.0.0.1", port, timeout=10, token=TOKEN)
    try:
        host, _, peer_port = store.get(f"ferrodist/addr/{peer}", timeout=10).decode().rpartition(":")
    finally:
        store.close()
    sock = connect_with_retry(host, int(peer_port), time.monotonic() + 10, "intruder", peer)
    with sock:
        connect_handshake(sock, TOKEN, time.monotonic() + 10, "intruder", peer)
        sock.sendall(encode_header(HELLO, rank, 0, world_size, 0))
        sock.settimeout(5)
        try:
            sock.recv(1)
        except OSError:
            pass


@pytest.mark.parametrize(
    ("claim", "reason"),
    [
        ((2, 5), "rank 2 was started with WORLD_SIZE=5 and rank 1 with WORLD_SIZE=3"),
        ((0, 3), "a process introduced itself to rank 1 as rank 0, but only ranks 2 to 2 connect to rank 1"),
    ],
    ids=["world-size", "rank"],
)
def test_a_hello_that_contradicts_the_job_stops_every_rank(claim, reason):
    port = free_port()
    threads, results, begin = start([(0, 3), (1, 3)], port)
    intruder_hello(port, 1, *claim)
    errors, took = finish(threads, results, begin)
    assert took < FAST
    for rank, error in enumerate(errors):
        assert isinstance(error, InvalidArgument), error
        assert str(error).startswith(f"rank {rank}: joining a job of 3 ranks through 127.0.0.1:{port}: the job cannot")
        assert reason in str(error)


def test_a_rank_that_is_not_in_the_job_tells_the_others():
    port = free_port()
    threads, results, begin = start([(0, 3), (1, 3), (3, 3)], port)
    errors, took = finish(threads, results, begin)
    assert took < FAST
    assert all(isinstance(e, InvalidArgument) for e in errors), errors
    assert all("got rank=3, world_size=3" in str(e) for e in errors)


def test_ranks_with_different_world_sizes_stop_every_rank():
    port = free_port()
    threads, results, begin = start([(0, 2), (1, 3)], port)
    errors, took = finish(threads, results, begin)
    assert took < FAST
    for error in errors:
        assert isinstance(error, InvalidArgument), error
        assert "rank 1 (pid" in str(error) and "was started with WORLD_SIZE=3 but rank 0 (pid" in str(error)
        assert "with WORLD_SIZE=2: start every rank with the same WORLD_SIZE" in str(error)


def test_shared_memory_slots_that_differ_stop_every_rank():
    port = free_port()
    threads, results, begin = start([(0, 2), (1, 2)], port, kind=ShmTransport, options={1: {"chunk": 512}})
    errors, took = finish(threads, results, begin)
    assert took < FAST
    for error in errors:
        assert isinstance(error, InvalidArgument), error
        assert f"rank 1 has FERRODIST_SHM_CHUNK=512, FERRODIST_SHM_SLOTS=2 but rank 0 has {default_chunk()}, 2" in str(
            error
        )


def test_closing_and_connecting_again_on_the_same_port_works_every_time():
    """Each rank closes and connects again in its own thread; every other round rank 1 is
    back before rank 0 has closed its previous store: it must wait for the new store, not
    join the old one."""
    port = free_port()
    rounds = 6
    got: dict[int, list] = {0: [], 1: []}

    def rank_loop(rank: int) -> None:
        for round_ in range(rounds):
            try:
                t = TcpTransport.connect(
                    rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=20, token=TOKEN
                )
            except FerrodistError as exc:
                got[rank].append(exc)
                return
            mine, theirs = np.array([10 * round_ + rank]), np.zeros(1, np.int64)
            request = t.irecv(theirs, src=1 - rank)
            t.send(mine, dst=1 - rank)
            request.wait(10)
            got[rank].append(int(theirs[0]))
            if rank == 0 and round_ % 2:
                time.sleep(0.3)
            t.close()

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert got[0] == [10 * r + 1 for r in range(rounds)]
    assert got[1] == [10 * r for r in range(rounds)]


def test_connecting_again_without_closing_names_this_process_s_own_store():
    port = free_port()
    first, _ = finish(*start([(0, 2), (1, 2)], port), close=False)
    try:
        assert not any(isinstance(t, FerrodistError) for t in first)
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="held by this process's own store") as info:
            TcpTransport.connect(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, token=TOKEN)
        assert time.monotonic() - started < 2
        assert "call destroy_process_group() (or close the transport) before initializing again" in str(info.value)
    finally:
        for transport in first:
            transport.close()


def register_late(port: int, rank: int, world_size: int) -> FerrodistError:
    """A second process registering as ``rank`` of the job on ``port`` once it has started
    (its own store client: this process's memory of joined stores would refuse that store)."""
    store = StoreClient("127.0.0.1", port, timeout=10, token=TOKEN, rank=rank)
    try:
        Rendezvous(store, rank, world_size, time.monotonic() + 10, f"rank {rank}: joining late").join()
    except FerrodistError as exc:
        return exc
    finally:
        store.close()
    raise AssertionError(f"a second process with rank {rank} was let in")


def barriers(transports) -> list[object]:
    """A barrier on every transport at once: what each returned or raised."""
    outcomes: list[object] = [None] * len(transports)

    def run(i: int) -> None:
        try:
            transports[i].barrier(timeout=10)
        except FerrodistError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(transports))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    return outcomes


def test_a_second_process_with_a_rank_just_after_the_start_stops_every_rank():
    """Processes started together start within milliseconds of each other when they are the
    right ones, and a duplicate's imports may take longer than that: it still stops the job."""
    port = free_port()
    transports, _ = finish(*start([(0, 2), (1, 2)], port), close=False)
    try:
        assert not any(isinstance(t, FerrodistError) for t in transports), transports
        error = register_late(port, 1, 2)
        assert isinstance(error, InvalidArgument), error
        assert "two processes were started as rank 1 (pid" in str(error)
        outcomes = barriers(transports)
        for rank, outcome in enumerate(outcomes):
            assert isinstance(outcome, FerrodistError), (rank, outcome)
            assert "two processes were started as rank 1 (pid" in str(outcome), outcome
    finally:
        for transport in transports:
            transport.close()


def test_a_second_process_with_a_rank_long_after_the_start_is_refused_alone(monkeypatch):
    monkeypatch.setattr(rendezvous, "START_GRACE", 0.2)
    port = free_port()
    transports, _ = finish(*start([(0, 2), (1, 2)], port), close=False)
    try:
        assert not any(isinstance(t, FerrodistError) for t in transports), transports
        time.sleep(0.4)
        error = register_late(port, 1, 2)
        assert isinstance(error, InvalidArgument), error
        assert "two processes were started as rank 1 (pid" in str(error)
        assert "the job had already been running for" in str(error), error
        assert barriers(transports) == [None, None]  # the job runs on
    finally:
        for transport in transports:
            transport.close()


def test_a_late_second_process_says_why_even_when_rank_0_closed_the_store_before_it_read():
    """A second process of rank 1 comes just after the start: it publishes why the job must
    stop, and rank 0 stops the job and closes its store at once, before this process reads
    the abort back. It raises its own reason, not the store's going away."""
    from ferrodist.core import PeerLost

    class Store:
        store_id = "a store that goes away"

        def __init__(self) -> None:
            self.data: dict[str, bytes] = {
                f"{rendezvous._JOIN}/1/1": b"2 4242 host-a",
                rendezvous._STARTED: str(time.time()).encode(),
                rendezvous._STOPPED: b"1",
            }
            self.counts: dict[str, int] = {f"{rendezvous._JOIN}/1": 1}
            self.published = False

        def add(self, key: str, amount: int, timeout: float) -> int:
            self.counts[key] = self.counts.get(key, 0) + amount
            return self.counts[key]

        def set(self, key: str, value: object, timeout: float) -> None:
            if key == rendezvous._ABORT:
                self.published = True  # rank 0 sees it, stops its ranks and closes the store
            self.data[key] = value if isinstance(value, bytes) else str(value).encode()

        def check(self, keys: list[str], timeout: float) -> bool:
            return all(k in self.data for k in keys) and not (self.published and rendezvous._ABORT in keys)

        def get(self, key: str, timeout: float) -> bytes:
            if self.published and key == rendezvous._ABORT:
                raise PeerLost("rendezvous store at 127.0.0.1:1: the store is shutting down", peer=0, rank=1)
            return self.data[key]

    rdv = Rendezvous(Store(), 1, 2, time.monotonic() + 10, "rank 1: joining a job of 2 ranks")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"stops it: two processes were started as rank 1 \(pid 4242 on host-a"):
        rdv.join()
    assert rdv.aborted
