"""The rendezvous store: a small key-value server hosted by rank 0, and its client.

Requests and answers are length-prefixed binary records on an authenticated TCP
connection (see ``auth``; the server runs every handshake at once, see ``accept``, and
gives a thread only to a client that holds the token). ``get`` and ``wait`` block on the
server until the keys exist or the caller's timeout passes, so ranks never poll. A record
is at most 64 MiB (a store holds addresses and reasons, not data), and a length read from
the wire is never reserved before its bytes arrive.

Every request of the client has a deadline, the caller's ``timeout``: the server's own
wait ends a little before it, so that its answer arrives in time, and a store that does
not answer by then (rank 0 stopped or overloaded) is a ``CollectiveTimeout``. The
connection that timed out is dropped (its answer may still come); the client keeps a few
connections and opens another when none is free, so one thread's long ``wait`` never
holds up another thread's ``set``.

Each server has a random id. A client is pinned to the server it first reached and
never takes an answer from another one (a store of a previous or a later process group
on the same port); it can also be told which ids to skip while it connects (``refuse``):
the rendezvous uses that so a rank never joins the store of a group it already left.

A server that closes (or whose process exits) first answers every request it has already
applied: rank 0 may see another rank's ``set`` and finish its job before that answer is
sent, and the other rank must not take the closed connection for a lost store.
"""

from __future__ import annotations

import atexit
import math
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable
from typing import Protocol, runtime_checkable

from ferrodist.core import BackendUnavailable, CollectiveTimeout, InvalidArgument, PeerLost, ProtocolError

from .accept import Gate, Refusals
from .auth import NotFerrodist, connect_handshake, job_token
from .net import HANDSHAKE_LIMIT, connect_with_retry, listen, recv_exact

__all__ = ["KeyValue", "StoreClient", "StoreServer"]

_REQUEST = struct.Struct("<BIQd")  # op, key bytes, value bytes, seconds the server may wait
_ANSWER = struct.Struct("<BQ")  # status, payload bytes
_SET, _GET, _ADD, _WAIT, _DELETE, _CHECK, _INFO = range(1, 8)
_OK, _TIMEOUT, _MISSING, _ERROR = range(4)
_MAX_RECORD = 64 << 20  # a store value is metadata: refuse anything near this size
_ANSWER_GRACE = 2.0  # the longest a closing server waits for the answers it owes


@runtime_checkable
class KeyValue(Protocol):
    """A key-value store every rank of a job already reaches, through which a job can
    start instead of through ``MASTER_ADDR:MASTER_PORT`` (see ``TcpTransport.connect``'s
    ``rendezvous=``): torch's ``c10d.Store`` (``TCPStore``, ``PrefixStore``, ``FileStore``)
    is one, as is any object with these two methods.
    """

    def get(self, key: str) -> bytes:
        """The value of ``key``, blocking until some rank sets it (within the store's own timeout)."""
        ...

    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``, visible to every rank."""
        ...


def _server_wait(timeout: float) -> float:
    """How long the server may wait for keys within a request of ``timeout`` seconds: a
    little less, so that its answer reaches the client before the client gives up."""
    return max(0.0, timeout - min(0.25, timeout / 4))


class StoreServer:
    """Serves the store on ``host:port`` from background threads until ``close()``.

    ``refusals`` counts the connections refused (see ``accept``); one is made when not given.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: bytes | None = None,
        handshake_timeout: float = HANDSHAKE_LIMIT,
        refusals: Refusals | None = None,
    ) -> None:
        self._token = job_token() if token is None else token
        self._listener = listen(host, port, "rendezvous store (rank 0)")
        self.refusals = Refusals() if refusals is None else refusals
        self._gate = Gate(
            self._listener, self._token, "rendezvous store", self.refusals, hello=False, limit=handshake_timeout
        )
        #: A random id: clients tell this store from an earlier or later one on the same port.
        self.store_id = secrets.token_hex(8)
        self._identity = f"{self.store_id} {os.getpid()} {socket.gethostname()}".encode()
        self._data: dict[str, bytes] = {}
        self._watches: dict[str, tuple[Callable[[bytes], None], float]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._clients: list[socket.socket] = []
        self._answering: set[int] = set()  # the threads between a request and its answer
        self._thread = threading.Thread(target=self._accept_loop, name="ferrodist-store", daemon=True)
        self._thread.start()
        self._at_exit = _close_at_exit(self)
        atexit.register(self._at_exit)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def address(self) -> str:
        """The address the store listens on."""
        return str(self._listener.getsockname()[0])

    def watch(self, key: str, callback: Callable[[bytes], None], *, until: float) -> None:
        """Call ``callback(value)`` once, when ``key`` is set before ``until`` (``time.monotonic()``):
        in the thread of the request that sets it, before that request is answered; or at once,
        in this thread, when it is set already."""
        with self._cond:
            value = self._data.get(key)
            if value is None:
                self._watches[key] = (callback, until)
                return
        callback(value)

    def close(self) -> None:
        """Stop serving: waiting requests are answered with an error, the others that were
        applied get their answers (within ``_ANSWER_GRACE`` seconds), then every connection
        is closed."""
        atexit.unregister(self._at_exit)
        me = threading.get_ident()
        with self._cond:
            self._closed = True
            self._watches.clear()
            self._cond.notify_all()
            give_up = time.monotonic() + _ANSWER_GRACE
            while self._answering - {me} and time.monotonic() < give_up:
                self._cond.wait(give_up - time.monotonic())
            clients, self._clients = self._clients, []
        self._gate.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        for sock in clients:
            _shutdown(sock)
        _shutdown(self._listener)

    def _accept_loop(self) -> None:
        try:
            while not self._closed:
                for sock, _ in self._gate.poll(None):
                    with self._cond:
                        if self._closed:
                            sock.close()
                            continue
                        self._clients.append(sock)
                    threading.Thread(
                        target=self._serve, args=(sock,), name="ferrodist-store-client", daemon=True
                    ).start()
        except (OSError, ValueError):
            return  # the listener was closed under us
        finally:
            self._gate.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(None)
            while True:
                header = _read(sock, _REQUEST.size)
                if header is None:
                    return
                op, key_len, value_len, timeout = _REQUEST.unpack(header)
                if key_len > _MAX_RECORD or value_len > _MAX_RECORD:
                    return  # not a ferrodist client: drop it (nothing was reserved for it)
                key = (_read(sock, key_len) or b"").decode()
                value = _read(sock, value_len) or b""
                try:
                    status, payload, fire = self._handle(op, key, value, timeout)
                    if fire is not None:
                        fire(value)
                    sock.sendall(_ANSWER.pack(status, len(payload)) + payload)
                finally:
                    with self._cond:
                        self._answering.discard(threading.get_ident())
                        self._cond.notify_all()
        except Exception:
            return
        finally:
            with self._cond:
                if sock in self._clients:
                    self._clients.remove(sock)
            _shutdown(sock)

    def _handle(
        self, op: int, key: str, value: bytes, timeout: float
    ) -> tuple[int, bytes, Callable[[bytes], None] | None]:
        """The answer to one request, and the watch it fires (to call outside the lock);
        the caller then owes the answer (``_answering``)."""
        with self._cond:
            self._answering.add(threading.get_ident())
            if op == _SET:
                self._data[key] = value
                self._cond.notify_all()
                watch = self._watches.pop(key, None)
                return _OK, b"", watch[0] if watch is not None and time.monotonic() < watch[1] else None
            return (*self._answer(op, key, value, timeout), None)

    def _answer(self, op: int, key: str, value: bytes, timeout: float) -> tuple[int, bytes]:
        """The answer to a request other than ``set`` (the caller holds the lock)."""
        if op == _INFO:
            return _OK, self._identity
        if op == _ADD:
            total = int(self._data.get(key, b"0")) + int(value)
            self._data[key] = str(total).encode()
            self._cond.notify_all()
            return _OK, str(total).encode()
        if op == _DELETE:
            return _OK, b"1" if self._data.pop(key, None) is not None else b"0"
        keys = key.split("\n") if key else []
        if op == _CHECK:
            return _OK, b"1" if all(k in self._data for k in keys) else b"0"
        if op in (_GET, _WAIT):
            deadline = time.monotonic() + timeout
            while not self._closed and not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return _TIMEOUT, "\n".join(k for k in keys if k not in self._data).encode()
                self._cond.wait(left)
            if self._closed:
                return _ERROR, b"the store is shutting down"
            return _OK, self._data[keys[0]] if op == _GET else b""
        return _ERROR, f"unknown store request {op}".encode()


class StoreClient:
    """Connections to the store on rank 0; safe to share between threads.

    Every method takes ``timeout=`` (seconds; default: the ``timeout`` given here) and
    returns or raises within it: ``CollectiveTimeout`` when the keys waited for were not
    set in time, or when the store did not answer in time (rank 0 stopped or overloaded);
    ``PeerLost`` when the store went away.

    Args:
        host, port: where rank 0 serves the store (``MASTER_ADDR``, ``MASTER_PORT``).
        timeout: seconds to reach the store (it may not have started yet: connecting
            is retried until then), and the default limit of every request.
        token: the job token (default ``FERRODIST_TOKEN``).
        rank: this process's rank, for messages.
        connect_timeout: seconds to reach the store, when not ``timeout`` (a caller that
            tries several addresses in turn gives each a short one).
        refuse: ids of stores not to use (see ``StoreServer.store_id``): while the store
            reached has one of them, the client waits for another to replace it.

    Raises:
        BackendUnavailable: what listens on ``host:port`` is not a ferrodist store.
        AuthenticationFailed: the store does not hold this job's token (or we do not).
        CollectiveTimeout: no store could be reached within ``timeout``.

    Example:
        >>> store = StoreClient("127.0.0.1", 29500, timeout=30)
        >>> store.set("rank/1/addr", b"10.0.0.2:41234")
        >>> store.get("rank/0/addr", timeout=30)
        b'10.0.0.1:40001'
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float,
        token: bytes | None = None,
        rank: int | None = None,
        refuse: Collection[str] = (),
        connect_timeout: float | None = None,
    ) -> None:
        self._host, self._port, self._rank = host, port, rank
        self._who = f"rank {rank}: " if rank is not None else ""
        self._where = f"{self._who}rendezvous store at {host}:{port}"
        self._timeout = _seconds(timeout, "StoreClient: timeout")
        self._token = job_token() if token is None else token
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._busy: set[socket.socket] = set()
        self._closed = False
        self.store_id = ""
        #: The process that hosts the store, as ``"pid N on HOST"``.
        self.host_process = ""
        reach = self._timeout if connect_timeout is None else _seconds(connect_timeout, "StoreClient: connect_timeout")
        self._idle.append(self._first_connection(time.monotonic() + reach, frozenset(refuse)))

    # -- connections ------------------------------------------------------------------------------
    def _first_connection(self, deadline: float, refuse: frozenset[str]) -> socket.socket:
        """Connect (retrying until ``deadline``: rank 0 may not listen yet) to a store whose
        id is not in ``refuse``, and pin this client to it."""
        delay, stale, dropped_since = 0.02, "", None
        while True:
            sock = connect_with_retry(self._host, self._port, deadline, self._where, peer=0)
            try:
                identity = self._introduce(sock, deadline, self._timeout)
                dropped_since = None
            except PeerLost:  # a store shutting down dropped us: its successor may come
                sock.close()
                identity = None
                dropped_since = dropped_since or time.monotonic()
                if time.monotonic() - dropped_since > HANDSHAKE_LIMIT:
                    raise BackendUnavailable(
                        f"{self._who}the process listening on {self._host}:{self._port} (MASTER_ADDR:MASTER_PORT) "
                        f"closed every connection for {HANDSHAKE_LIMIT:g} s without the ferrodist handshake: it is "
                        "not a ferrodist store; choose a free MASTER_PORT (`ferrodist run` picks one by itself)",
                        rank=self._rank,
                    ) from None
            except BaseException:
                sock.close()
                raise
            if identity is not None:
                store_id, pid, host = identity
                if store_id not in refuse:
                    self.store_id, self.host_process = store_id, f"pid {pid} on {host}"
                    return sock
                sock.close()
                stale = f"pid {pid} on {host}"
            if time.monotonic() + delay > deadline:
                if stale:
                    raise CollectiveTimeout(
                        f"{self._who}the store at {self._host}:{self._port} ({stale}) is still the one of a "
                        "process group this rank has already left: rank 0 did not destroy that group and start a "
                        "new one in time (every rank must call destroy_process_group() before "
                        "init_process_group() again)",
                        rank=self._rank,
                        waiting_for=(0,),
                    )
                raise CollectiveTimeout(
                    f"{self._who}the store at {self._host}:{self._port} kept closing connections until the deadline "
                    "(rank 0 is shutting it down?)",
                    rank=self._rank,
                    waiting_for=(0,),
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _introduce(self, sock: socket.socket, deadline: float, limit: float) -> tuple[str, str, str]:
        """The token handshake on a new connection, then the store's id, pid and host
        (``limit``: the seconds the caller gave, for messages)."""
        try:
            connect_handshake(sock, self._token, deadline, self._where, peer=0)
        except NotFerrodist as exc:
            raise BackendUnavailable(
                f"{self._who}the process listening on {self._host}:{self._port} (MASTER_ADDR:MASTER_PORT) is not a "
                f"ferrodist store: {exc.reason}. Another program holds that port (or rank 0 is stopped): choose a "
                "free MASTER_PORT (`ferrodist run` picks one by itself)",
                rank=self._rank,
            ) from None
        except CollectiveTimeout:
            raise self._no_answer(limit) from None
        status, payload = self._exchange(sock, _INFO, b"", b"", 0.0, deadline, limit)
        parts = payload.decode(errors="replace").split()
        if status != _OK or len(parts) != 3:
            raise ProtocolError(f"{self._where}: the store answered its introduction with {payload[:80]!r}")
        return parts[0], parts[1], parts[2]

    def _take(self, deadline: float, limit: float) -> socket.socket:
        """A free connection to this client's store, or a new one."""
        with self._lock:
            self._check_open()
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            sock = connect_with_retry(self._host, self._port, deadline, self._where, peer=0, retry=False)
            try:
                store_id, _, _ = self._introduce(sock, deadline, limit)
            except BaseException:
                sock.close()
                raise
            if store_id != self.store_id:
                sock.close()
                raise PeerLost(
                    f"{self._who}the store at {self._host}:{self._port} is not the one this client joined any more: "
                    "rank 0 closed it (it destroyed its process group) and another took its port",
                    peer=0,
                    rank=self._rank,
                )
        with self._lock:
            if self._closed:
                _shutdown(sock)
                self._check_open()
            self._busy.add(sock)
        return sock

    def _give(self, sock: socket.socket, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(sock)
            if reusable and not self._closed:
                self._idle.append(sock)
                return
        _shutdown(sock)

    def _check_open(self) -> None:
        if self._closed:
            raise PeerLost(f"{self._who}this store client is closed", peer=0, rank=self._rank)

    def close(self) -> None:
        """Close every connection (a request in flight in another thread fails at once)."""
        with self._lock:
            self._closed = True
            socks, self._idle = [*self._idle, *self._busy], []
            self._busy.clear()
        for sock in socks:
            _shutdown(sock)

    # -- requests ---------------------------------------------------------------------------------
    def _no_answer(self, limit: float) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"{self._who}the store on rank 0 ({self._host}:{self._port}) did not answer within {limit:g} s "
            "(rank 0 may be stopped or overloaded)",
            rank=self._rank,
            waiting_for=(0,),
        )

    def _exchange(
        self, sock: socket.socket, op: int, key: bytes, value: bytes, wait: float, deadline: float, limit: float
    ) -> tuple[int, bytes]:
        """One request and its answer on ``sock``, both before ``deadline``."""
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(_REQUEST.pack(op, len(key), len(value), wait) + key + value)
            status, length = _ANSWER.unpack(recv_exact(sock, _ANSWER.size, deadline, self._where, 0))
            if length > _MAX_RECORD:
                raise ProtocolError(
                    f"{self._where} (rank 0) announced a record of {length} bytes, over the store's limit of "
                    f"{_MAX_RECORD} (nothing was read or reserved for it): what listens there is not a ferrodist "
                    "store of this version, or the connection is corrupt",
                    rank=self._rank,
                )
            payload = recv_exact(sock, length, deadline, self._where, 0) if length else b""
        except TimeoutError:  # CollectiveTimeout from recv_exact, or the send's socket timeout
            raise self._no_answer(limit) from None
        except OSError as exc:  # PeerLost from recv_exact, or a failed send
            reason = "it closed the connection" if isinstance(exc, PeerLost) else f"the connection broke ({exc})"
            raise PeerLost(
                f"{self._who}the store on rank 0 ({self._host}:{self._port}) went away: {reason}; rank 0 exited, "
                "crashed or destroyed its process group",
                peer=0,
                rank=self._rank,
            ) from None
        if status == _ERROR:
            raise PeerLost(f"{self._where}: {payload.decode(errors='replace')}", peer=0, rank=self._rank)
        return status, payload

    def _call(self, op: int, key: str, value: bytes, timeout: float | None, waits: bool = False) -> tuple[int, bytes]:
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        sock = self._take(deadline, limit)
        reusable = False
        try:
            wait = _server_wait(limit) if waits else 0.0
            answer = self._exchange(sock, op, key.encode(), value, wait, deadline, limit)
            reusable = True
            return answer
        finally:
            # A connection whose answer did not come is dropped: that answer may still arrive.
            self._give(sock, reusable)

    def _limit(self, timeout: float | None) -> float:
        return self._timeout if timeout is None else _seconds(timeout, f"{self._where}: timeout")

    def set(self, key: str, value: bytes | str, *, timeout: float | None = None) -> None:
        """Set ``key`` to ``value``."""
        self._call(_SET, _key(key), value.encode() if isinstance(value, str) else bytes(value), timeout)

    def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set."""
        limit = self._limit(timeout)
        status, payload = self._call(_GET, _key(key), b"", limit, waits=True)
        if status == _TIMEOUT:
            raise CollectiveTimeout(f"{self._where}: key {key!r} was not set within {limit:g} s", rank=self._rank)
        return payload

    def add(self, key: str, amount: int, *, timeout: float | None = None) -> int:
        """Add ``amount`` to the integer at ``key`` (0 if unset) and return the new value."""
        return int(self._call(_ADD, _key(key), str(int(amount)).encode(), timeout)[1])

    def wait(self, keys: Iterable[str], *, timeout: float | None = None) -> None:
        """Block until every key is set; ``CollectiveTimeout`` names the missing ones."""
        names = [_key(k) for k in keys]
        limit = self._limit(timeout)
        status, payload = self._call(_WAIT, "\n".join(names), b"", limit, waits=True)
        if status == _TIMEOUT:
            missing = payload.decode().split("\n")
            raise CollectiveTimeout(f"{self._where}: keys {missing} were not set within {limit:g} s", rank=self._rank)

    def check(self, keys: Iterable[str], *, timeout: float | None = None) -> bool:
        """Whether every key is set (without waiting for them)."""
        return self._call(_CHECK, "\n".join(_key(k) for k in keys), b"", timeout)[1] == b"1"

    def delete(self, key: str, *, timeout: float | None = None) -> bool:
        """Remove ``key``; whether it was there."""
        return self._call(_DELETE, _key(key), b"", timeout)[1] == b"1"


def _close_at_exit(server: StoreServer) -> Callable[[], None]:
    """A function for ``atexit`` that closes ``server`` if it is still alive (it does not
    keep the server alive)."""
    ref = weakref.ref(server)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    return close


def _seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise InvalidArgument(f"{what} must be a non-negative number of seconds, not {value!r}")
    return float(value)


def _key(key: str) -> str:
    if not isinstance(key, str) or not key or "\n" in key:
        raise InvalidArgument(f"store keys are non-empty strings without newlines, not {key!r}")
    return key


def _read(sock: socket.socket, count: int) -> bytes | None:
    """Exactly ``count`` bytes, or ``None`` at a clean end of stream (server side, no deadline)."""
    chunks = bytearray()
    while len(chunks) < count:
        part = sock.recv(min(count - len(chunks), 1 << 20))
        if not part:
            return None
        chunks += part
    return bytes(chunks)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
