"""Starting a job: the store, each rank's registration, and what ends a start.

1. Rank 0 hosts the store on the master port; every rank connects to it (``open_store``),
   but never to a store this process has already joined as this rank: that one belongs
   to a process group it left, and rank 0 is about to replace it. A job that already
   has a key-value store (torch's, under torchrun) starts through it instead
   (``open_store_through``): rank 0 hosts the store on a port the OS picks and publishes
   where it is there, so no port has to be agreed on and none can clash.
2. Each rank registers (``Rendezvous.join``): ``ferrodist/join/<rank>`` counts the
   processes that claim the rank and ``ferrodist/join/<rank>/<n>`` says who each is (world
   size, pid, host). A second process with the same rank, or a world size other than
   rank 0's, is a conflict.
3. The ranks connect pairwise (``mesh``).
4. Every rank looks for an abort once more (``Rendezvous.finish``), and rank 0 marks the
   job started (``ferrodist/started``).

A rank that finds a conflict (or a HELLO that contradicts the job) publishes the reason
under ``ferrodist/abort``; every wait of the rendezvous looks at that key at least every
``POLL`` seconds, so every rank raises the same error within a second or two instead of
waiting out its timeout. A rank whose own arguments are wrong reports them there too
(``report_bad_start``).

The right ranks of a job started together finish their start within milliseconds of
each other, often before a wrong one (a second process with one of their ranks, say)
has registered: its process may take tens of milliseconds longer to import. So rank 0
also watches for an abort for ``START_GRACE`` seconds after the start and then stops the
job on every rank (its transport says goodbye with the reason). An abort that comes
later than that is another job's on the same ``MASTER_PORT``, or a stray process's: it
fails alone, and the job runs on.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ferrodist.core import (
    AuthenticationFailed,
    BackendUnavailable,
    CollectiveTimeout,
    FerrodistError,
    InvalidArgument,
    InvalidRank,
    PeerLost,
    ProtocolError,
)

from .accept import Refusals
from .auth import CLOSE_IT, say_open
from .net import HANDSHAKE_LIMIT, PortInUse, store_address
from .store import KeyValue, StoreClient, StoreServer

__all__ = [
    "POLL",
    "START_GRACE",
    "STORE_KEY",
    "Rendezvous",
    "open_store",
    "open_store_through",
    "report_bad_start",
]

#: The longest a rendezvous wait goes without looking for an abort (seconds).
POLL = 0.5
#: Seconds after the start during which an abort (a second process with one of the job's
#: ranks, a rank with another WORLD_SIZE) still stops the whole job.
START_GRACE = 10.0
_JOIN = "ferrodist/join"
_ABORT = "ferrodist/abort"
_ABORTS = "ferrodist/aborts"
_SEEN = "ferrodist/abort-seen"
_STARTED = "ferrodist/started"
_STOPPED = "ferrodist/stopped"
_REFUSED = "ferrodist/refused"
#: The key of an outside key-value store under which rank 0 publishes where its store is.
STORE_KEY = "ferrodist/store"
#: What rank 0 of a job started through an outside store without FERRODIST_TOKEN says.
OPEN_THROUGH_A_STORE = (
    "ferrodist: FERRODIST_TOKEN is not set, so this job's connections are not authenticated: it started through "
    "the job's own key-value store (torch's store under torchrun), which anyone who reaches it can read, so no "
    "secret is kept there, and any process that reaches MASTER_PORT or this job's ports can join the job or send "
    f"it data. {CLOSE_IT}"
)
#: Error classes an abort may carry (anything else arrives as ``FerrodistError``).
_KINDS: dict[str, type[FerrodistError]] = {
    cls.__name__: cls for cls in (InvalidArgument, InvalidRank, BackendUnavailable, ProtocolError, AuthenticationFailed)
}


class _Joined:
    """The stores this process has joined, and as which rank (the most recent 1024).

    A rank that calls ``init_process_group`` again may find rank 0's previous store still
    up (rank 0 has not destroyed its group yet): it must not join that one. Nothing ever
    needs to reset this memory: store ids are random, so an id seen before is that store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()

    def add(self, store_id: str, rank: int) -> None:
        with self._lock:
            self._seen[(store_id, rank)] = None
            while len(self._seen) > 1024:
                self._seen.popitem(last=False)

    def ids(self, rank: int) -> frozenset[str]:
        with self._lock:
            return frozenset(store_id for store_id, r in self._seen if r == rank)


JOINED = _Joined()


def open_store(
    rank: int,
    master_addr: str,
    master_port: int,
    token: bytes,
    deadline: float,
    what: str,
    refusals: Refusals | None = None,
) -> tuple[StoreClient, StoreServer | None]:
    """Rank 0 starts the store (on the address ``master_addr`` names, see ``store_address``);
    every rank connects to it. Returns the client and, on rank 0, the server (which counts
    what it refused in ``refusals``).

    Raises:
        BackendUnavailable: the master port is held by something else (a program that
            is not ferrodist, another job's store, this process's previous group).
    """
    server = None
    if rank == 0:
        try:
            server = StoreServer(store_address(master_addr), master_port, token=token, refusals=refusals)
        except PortInUse as exc:
            return _join_existing_store(master_addr, master_port, token, deadline, what, exc), None
    try:
        client = StoreClient(
            master_addr,
            master_port,
            timeout=max(0.0, deadline - time.monotonic()),
            token=token,
            rank=rank,
            refuse=JOINED.ids(rank),
        )
    except BaseException:
        if server is not None:
            server.close()
        raise
    return client, server


def open_store_through(
    kv: KeyValue, rank: int, host: str, token: bytes, deadline: float, what: str, refusals: Refusals | None = None
) -> tuple[StoreClient, StoreServer | None, bytes]:
    """Start through a key-value store the job already has (``kv``): rank 0 hosts the store
    on ``host`` and a port the OS picks, and publishes ``"host:port store-id -"`` under
    ``STORE_KEY``; every other rank reads that and connects. Returns the client, the server
    on rank 0, and the job token, ``token``. No secret is ever put in ``kv``: torch's store,
    for one, lets anyone who reaches its port read it. Without ``token`` the job is open to
    anyone who reaches its ports, and rank 0 says so once, with how to close it.

    A record left in ``kv`` by an earlier group (one this process joined, or whose store
    has gone) is read again until rank 0 replaces it, within ``deadline``.

    Raises:
        CollectiveTimeout: rank 0 published nothing in time, or its store did not answer.
        BackendUnavailable: ``kv`` failed (its error is in the message).
        AuthenticationFailed: this rank's ``FERRODIST_TOKEN`` is not rank 0's.
    """
    if not token:
        say_open(OPEN_THROUGH_A_STORE if rank == 0 else None)
    if rank == 0:
        server = StoreServer(host, 0, token=token, refusals=refusals)
        try:
            _kv_call(kv.set, (STORE_KEY, f"{host}:{server.port} {server.store_id} -".encode()), deadline, what)
            client = StoreClient(host, server.port, timeout=max(0.05, deadline - time.monotonic()), token=token, rank=0)
        except BaseException:
            server.close()
            raise
        return client, server, token
    delay, last = 0.02, None
    while True:
        record = _kv_call(kv.get, (STORE_KEY,), deadline, what).decode(errors="replace")
        address, store_id = [*record.split(" "), "", ""][:2]
        store_host, _, port = address.rpartition(":")
        if not store_host or not port.isdigit() or not store_id:
            raise ProtocolError(f"{what}: the key {STORE_KEY!r} of the job's key-value store holds {record[:80]!r}")
        secret = token
        left = deadline - time.monotonic()
        if store_id not in JOINED.ids(rank):  # else: the store of a group this process has left
            try:
                client = StoreClient(
                    store_host,
                    int(port),
                    timeout=max(0.05, left),
                    connect_timeout=max(0.05, min(left, HANDSHAKE_LIMIT)),
                    token=secret,
                    rank=rank,
                    refuse=JOINED.ids(rank),
                )
            except (CollectiveTimeout, PeerLost, BackendUnavailable) as exc:
                last = exc  # a record of a store that has gone: rank 0 is about to replace it
            else:
                if client.store_id == store_id:
                    return client, None, secret
                client.close()
        if time.monotonic() + delay >= deadline:
            raise CollectiveTimeout(
                f"{what}: rank 0 did not publish a store this rank could join under {STORE_KEY!r} in time (the "
                f"last record, {record!r}, is "
                + (f"unreachable: {last}" if last is not None else "that of a process group this rank has left")
                + "); is rank 0 running and starting the same group?",
                rank=rank,
                waiting_for=(0,),
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def _kv_call(method: Callable[..., Any], args: tuple[Any, ...], deadline: float, what: str) -> Any:
    """``method(*args)`` of an outside key-value store, given up at ``deadline``: it runs
    in a thread of its own, since such a store may block for as long as its own timeout."""
    box: list[Any] = []
    done = threading.Event()

    def call() -> None:
        try:
            box.append((True, method(*args)))
        except BaseException as exc:
            box.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=call, name="ferrodist-kv", daemon=True).start()
    name = getattr(method, "__name__", "call")
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise CollectiveTimeout(
            f"{what}: the job's key-value store did not answer {name}({args[0]!r}) in time"
            + (" (rank 0 has not published its store: is it running?)" if name == "get" else ""),
            waiting_for=(0,) if name == "get" else (),
        )
    ok, value = box[0]
    if not ok:
        if name == "get" and "timeout" in str(value).lower():
            raise CollectiveTimeout(
                f"{what}: rank 0 did not publish its store under {args[0]!r} before the key-value store's own "
                f"timeout ({type(value).__name__}: {value}); is rank 0 running?",
                waiting_for=(0,),
            ) from value
        raise BackendUnavailable(
            f"{what}: the job's key-value store failed {name}({args[0]!r}): {type(value).__name__}: {value}"
        ) from value
    if name == "get" and not isinstance(value, (bytes, bytearray)):
        value = value.encode() if isinstance(value, str) else bytes(value)
    return value


def _join_existing_store(
    master_addr: str, master_port: int, token: bytes, deadline: float, what: str, in_use: PortInUse
) -> StoreClient:
    """Rank 0 found the master port taken: say by what. When it is a store of this job
    (another process started as rank 0), join it, so that the duplicate is reported to
    every rank."""
    try:
        client = StoreClient(
            master_addr,
            master_port,
            timeout=min(max(0.0, deadline - time.monotonic()), HANDSHAKE_LIMIT + 1),
            token=token,
            rank=0,
        )
    except AuthenticationFailed:
        raise BackendUnavailable(
            f"{what}: cannot host the store: port {master_port} is held by the store of another ferrodist job "
            "(one with another FERRODIST_TOKEN); choose another MASTER_PORT",
            rank=0,
        ) from None
    except BackendUnavailable:
        raise BackendUnavailable(
            f"{what}: cannot host the store: port {master_port} is held by a program that is not a ferrodist store "
            "(it does not answer the ferrodist handshake); choose another MASTER_PORT (`ferrodist run` picks a free "
            "one by itself)",
            rank=0,
        ) from None
    except FerrodistError:
        raise in_use from None
    if client.store_id in JOINED.ids(0):
        client.close()
        raise BackendUnavailable(
            f"{what}: cannot host the store: port {master_port} is held by this process's own store, that of a "
            "process group it has not destroyed; call destroy_process_group() (or close the transport) before "
            "initializing again",
            rank=0,
        )
    return client


def report_bad_start(
    rank: object, world_size: object, master_addr: str, master_port: int, token: bytes, error: FerrodistError
) -> None:
    """Best effort, within a few seconds: tell the job's other ranks why this one cannot
    join (``error``), so that they stop waiting for it. Rank 0 hosts the store for as
    long as it takes them to read it (``Rendezvous.linger``)."""
    server = None
    if rank == 0:
        try:
            server = StoreServer(store_address(master_addr), master_port, token=token)
        except FerrodistError:
            return
    elif not isinstance(rank, int) or rank < 0:
        return
    try:
        store = StoreClient(master_addr, master_port, timeout=HANDSHAKE_LIMIT, token=token)
        try:
            _publish(store, error, HANDSHAKE_LIMIT)
            store.add(_SEEN, 1, timeout=HANDSHAKE_LIMIT)  # this process knows
            if server is not None:  # rank 0: keep the store up until the others know too
                Rendezvous(store, 0, world_size if isinstance(world_size, int) else 1, 0.0, "").linger()
        finally:
            store.close()
    except FerrodistError:
        pass
    finally:
        if server is not None:
            server.close()


def _publish(store: StoreClient, error: FerrodistError, timeout: float) -> None:
    """Make ``error`` the job's abort, unless another rank's came first."""
    if store.add(_ABORTS, 1, timeout=timeout) == 1:
        store.set(_ABORT, f"{type(error).__name__}\n{error.message}", timeout=timeout)


class Rendezvous:
    """One rank's part of starting a job: waits on the store that notice an abort, and
    the abort itself. Every rank of the job that is still starting raises the first
    abort published, with its reason. ``refusals``: the connections this rank's ports
    refused (rank 0 publishes its count while it waits, for the others' messages)."""

    def __init__(
        self,
        store: StoreClient,
        rank: int,
        world_size: int,
        deadline: float,
        what: str,
        refusals: Refusals | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.deadline = deadline
        self.what = what
        self.aborted = False
        self.refusals = Refusals() if refusals is None else refusals
        self._checked = time.monotonic()
        self._told = 0

    def left(self) -> float:
        """Seconds to the deadline (a request with no time left at all still gets 50 ms)."""
        return max(0.05, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    # -- aborting -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the job's abort if a rank has published one."""
        self._checked = time.monotonic()
        if self.store.check([_ABORT], timeout=self.left()):
            self._raise_abort(self.left())

    def check_due(self) -> None:
        """``check``, if the last one was ``POLL`` seconds ago or more (rank 0 also publishes
        what its ports refused since, see ``outside``)."""
        if time.monotonic() - self._checked >= POLL:
            self.check()
            refused = self.refusals.total()
            if self.rank == 0 and refused != self._told:
                self._told = refused
                self.store.set(_REFUSED, self.refusals.describe("rank 0"), timeout=self.left())

    def outside(self) -> str:
        """A clause for a start that failed: the connections from outside the job that this
        rank refused and, on another rank, those rank 0 published; '' when there were none."""
        note = self.refusals.describe("this rank")
        if self.rank != 0:
            try:
                if self.store.check([_REFUSED], timeout=0.3):
                    note += self.store.get(_REFUSED, timeout=0.3).decode(errors="replace")
            except FerrodistError:
                pass
        return note

    def finish(self, server: StoreServer | None, stop: Callable[[FerrodistError], None]) -> None:
        """The end of this rank's start: look for an abort once more; on rank 0, mark the job
        started and, for ``START_GRACE`` seconds, stop it on every rank (``stop``, with the
        reason) when an abort is published (see the module docstring)."""
        self.check()
        if server is None:
            return
        self.store.set(_STARTED, repr(time.time()), timeout=self.left())

        def stopped(value: bytes) -> None:
            kind, _, reason = value.decode(errors="replace").partition("\n")
            try:
                self.store.set(_STOPPED, b"", timeout=1.0)  # before the process that published it is answered
            except FerrodistError:
                pass
            error = _KINDS.get(kind, FerrodistError)(
                f"{self.what}: the job stopped just after it started: {reason}", rank=0
            )
            # A rank 0 still in its start raises this and keeps the store up (``linger``)
            # until the ranks still starting have read the reason, not a store gone away.
            self.aborted = True
            stop(error)

        server.watch(_ABORT, stopped, until=time.monotonic() + START_GRACE)

    def check_after(self, error: FerrodistError) -> NoReturn:
        """A peer dropped the connection during the handshake: if it did so because it
        published an abort, raise that; else ``error``."""
        try:
            self.store.get(_ABORT, timeout=min(1.0, self.left()))
        except FerrodistError:
            raise error from None
        self._raise_abort(self.left())

    def abort(self, error: FerrodistError) -> NoReturn:
        """Publish ``error`` as the reason the job cannot start (unless another rank's came
        first) and raise the published one. When the job had started already (this process
        came late), say so, and whether rank 0 stopped it (see ``START_GRACE``)."""
        timeout = max(1.0, min(self.left(), 5.0))
        try:
            _publish(self.store, error, timeout)
            since = self._started_since(timeout)
        except FerrodistError:
            raise error.with_context(self.what) from None
        if since is None:
            self._raise_abort(timeout, mine=error)
        try:
            stopped = self.store.check([_STOPPED], timeout=timeout)
        except FerrodistError:
            stopped = False
        if stopped:
            self._raise_abort(timeout, f"rank 0 had started the job {since:.2f} s before, and stops it", mine=error)
        self.aborted = True
        raise error.with_context(
            f"{self.what}: the job had already been running for {since:.2f} s when this process came, and runs on "
            "without it"
        )

    def _started_since(self, timeout: float) -> float | None:
        """Seconds since rank 0 marked the job started (its clock), or None if it has not."""
        if not self.store.check([_STARTED], timeout=timeout):
            return None
        try:
            return max(0.0, time.time() - float(self.store.get(_STARTED, timeout=timeout)))
        except ValueError:
            return 0.0

    def _raise_abort(
        self, timeout: float, what_happened: str = "the job cannot start", mine: FerrodistError | None = None
    ) -> NoReturn:
        """Raise the job's published abort. ``mine``: the reason this process published; raised
        instead where the store is gone before the abort is read (rank 0 stops a started job
        at once and closes its store, perhaps before the late process that stopped it reads)."""
        try:
            published = self.store.get(_ABORT, timeout=timeout)
        except FerrodistError:
            if mine is None:
                raise
            self.aborted = True
            raise mine.with_context(f"{self.what}: {what_happened}") from None
        kind, _, reason = published.decode(errors="replace").partition("\n")
        self.aborted = True
        try:
            self.store.add(_SEEN, 1, timeout=min(1.0, timeout))
            self.store.add(f"{_SEEN}/{self.rank}", 1, timeout=min(1.0, timeout))
        except FerrodistError:
            pass
        raise _KINDS.get(kind, FerrodistError)(f"{self.what}: {what_happened}: {reason}", rank=self.rank)

    def linger(self, seconds: float = HANDSHAKE_LIMIT) -> None:
        """On rank 0 after an abort: keep the store up until every process that joined (a
        duplicate rank is one more) and every rank has seen the abort (``seconds`` at most),
        so that those still starting get its reason, not a store that has gone."""
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            try:
                every_rank = self.store.check([f"{_SEEN}/{r}" for r in range(self.world_size)], timeout=0.5)
                joined = sum(self.store.add(f"{_JOIN}/{r}", 0, timeout=0.5) for r in range(self.world_size))
                if every_rank and int(self.store.get(_SEEN, timeout=0.5)) >= joined:
                    return
            except (FerrodistError, ValueError):
                pass
            time.sleep(0.05)

    # -- waiting ------------------------------------------------------------------------------
    def get(self, key: str, peer: int, never: str) -> bytes:
        """The value of ``key``, which rank ``peer`` sets; ``CollectiveTimeout`` saying that
        rank ``peer`` ``never`` ... when it is not set by the deadline."""
        while True:
            try:
                return self.store.get(key, timeout=min(POLL, self.left()))
            except CollectiveTimeout:
                if self.expired():
                    raise CollectiveTimeout(
                        f"{self.what}: rank {peer} never {never}", rank=self.rank, waiting_for=(peer,)
                    ) from None
                self.check()

    # -- registering ----------------------------------------------------------------------------
    def join(self) -> None:
        """Register this rank; abort the job if another process has the same rank, or if
        this rank's world size is not rank 0's."""
        store, rank = self.store, self.rank
        me = f"{self.world_size} {os.getpid()} {socket.gethostname()}"
        count = store.add(f"{_JOIN}/{rank}", 1, timeout=self.left())
        store.set(f"{_JOIN}/{rank}/{count}", me, timeout=self.left())
        JOINED.add(store.store_id, rank)
        self.check()  # a rank that could not start may have said so already
        if count > 1:
            try:
                first = _process(store.get(f"{_JOIN}/{rank}/1", timeout=min(1.0, self.left())).decode())
            except FerrodistError:
                first = "another process"
            self.abort(
                InvalidArgument(
                    f"two processes were started as rank {rank} ({first} and {_process(me)}): "
                    f"give each process its own RANK, 0 to {self.world_size - 1} (and each job its own MASTER_PORT)"
                )
            )
        if rank != 0:
            zero = self.get(f"{_JOIN}/0/1", 0, "registered with its own store").decode()
            size = int(zero.split()[0])
            if size != self.world_size:
                self.abort(
                    InvalidArgument(
                        f"rank {rank} ({_process(me)}) was started with WORLD_SIZE={self.world_size} but rank 0 "
                        f"({_process(zero)}) with WORLD_SIZE={size}: start every rank with the same WORLD_SIZE"
                    )
                )


def _process(record: str) -> str:
    """``"pid N on HOST"`` from a registration (``"<world size> <pid> <host>"``)."""
    _, pid, host = [*record.split(" ", 2), "?", "?"][:3]
    return f"pid {pid} on {host}"
