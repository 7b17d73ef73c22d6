"""The rendezvous store: a small key-value server hosted by rank 0, and its client.

Requests and answers are length-prefixed binary records on an authenticated TCP
connection (see ``_auth``). ``get`` and ``wait`` block on the server until the keys
exist or the caller's timeout passes, so ranks never poll.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterable

from ferrodist.core import CollectiveTimeout, InvalidArgument, PeerLost, ProtocolError

from ._auth import accept_handshake, connect_handshake, job_token
from ._net import connect_with_retry, listen, recv_exact

__all__ = ["StoreClient", "StoreServer"]

_REQUEST = struct.Struct("<BIQd")  # op, key bytes, value bytes, timeout (s)
_ANSWER = struct.Struct("<BQ")  # status, payload bytes
_SET, _GET, _ADD, _WAIT, _DELETE, _CHECK = range(1, 7)
_OK, _TIMEOUT, _MISSING, _ERROR = range(4)
_MAX_RECORD = 64 << 20  # a store value is metadata: refuse anything near this size


class StoreServer:
    """Serves the store on ``host:port`` from background threads until ``close()``."""

    def __init__(self, host: str, port: int, *, token: bytes | None = None, handshake_timeout: float = 30.0) -> None:
        self._token = job_token() if token is None else token
        self._handshake_timeout = handshake_timeout
        self._listener = listen(host, port, "rendezvous store (rank 0)")
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._clients: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept_loop, name="ferrodist-store", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            clients, self._clients = self._clients, []
        for sock in clients:
            _shutdown(sock)
        _shutdown(self._listener)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._cond:
                if self._closed:
                    sock.close()
                    return
                self._clients.append(sock)
            threading.Thread(target=self._serve, args=(sock,), name="ferrodist-store-client", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            accept_handshake(sock, self._token, time.monotonic() + self._handshake_timeout, "rendezvous store")
            sock.settimeout(None)
            while True:
                header = _read(sock, _REQUEST.size)
                if header is None:
                    return
                op, key_len, value_len, timeout = _REQUEST.unpack(header)
                if key_len > _MAX_RECORD or value_len > _MAX_RECORD:
                    return  # not a ferrodist client: drop it without allocating
                key = (_read(sock, key_len) or b"").decode()
                value = _read(sock, value_len) or b""
                status, payload = self._handle(op, key, value, timeout)
                sock.sendall(_ANSWER.pack(status, len(payload)) + payload)
        except Exception:
            return
        finally:
            with self._cond:
                if sock in self._clients:
                    self._clients.remove(sock)
            _shutdown(sock)

    def _handle(self, op: int, key: str, value: bytes, timeout: float) -> tuple[int, bytes]:
        with self._cond:
            if op == _SET:
                self._data[key] = value
                self._cond.notify_all()
                return _OK, b""
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
    """A connection to the store on rank 0; safe to share between threads.

    Example:
        >>> store = StoreClient("127.0.0.1", 29500, timeout=30)
        >>> store.set("rank/1/addr", b"10.0.0.2:41234")
        >>> store.get("rank/0/addr", timeout=30)
        b'10.0.0.1:40001'
    """

    def __init__(self, host: str, port: int, *, timeout: float, token: bytes | None = None, rank: int | None = None):
        self._where = (
            f"rank {rank}: rendezvous store at {host}:{port}" if rank is not None else f"store at {host}:{port}"
        )
        deadline = time.monotonic() + timeout
        self._sock = connect_with_retry(host, port, deadline, self._where, peer=0)
        try:
            connect_handshake(self._sock, job_token() if token is None else token, deadline, self._where, peer=0)
        except BaseException:
            self._sock.close()
            raise
        self._lock = threading.Lock()

    def close(self) -> None:
        _shutdown(self._sock)

    def _call(self, op: int, key: str, value: bytes = b"", timeout: float = 0.0) -> tuple[int, bytes]:
        raw_key = key.encode()
        with self._lock:
            try:
                self._sock.settimeout(timeout + 30.0)  # the server answers by then, or is gone
                self._sock.sendall(_REQUEST.pack(op, len(raw_key), len(value), timeout) + raw_key + value)
                deadline = time.monotonic() + timeout + 30.0
                status, length = _ANSWER.unpack(recv_exact(self._sock, _ANSWER.size, deadline, self._where, 0))
                if length > _MAX_RECORD:
                    raise ProtocolError(f"{self._where}: answered a record of {length} bytes")
                payload = recv_exact(self._sock, length, deadline, self._where, 0) if length else b""
            except (TimeoutError, OSError) as exc:
                raise PeerLost(f"{self._where}: the store stopped answering ({exc})", peer=0) from None
        if status == _ERROR:
            raise PeerLost(f"{self._where}: {payload.decode(errors='replace')}", peer=0)
        return status, payload

    def set(self, key: str, value: bytes | str) -> None:
        self._call(_SET, _key(key), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str, *, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set."""
        status, payload = self._call(_GET, _key(key), timeout=timeout)
        if status == _TIMEOUT:
            raise CollectiveTimeout(f"{self._where}: key {key!r} was not set within {timeout:g} s")
        return payload

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 if unset) and return the new value."""
        return int(self._call(_ADD, _key(key), str(int(amount)).encode())[1])

    def wait(self, keys: Iterable[str], *, timeout: float) -> None:
        """Block until every key is set; ``CollectiveTimeout`` names the missing ones."""
        names = [_key(k) for k in keys]
        status, payload = self._call(_WAIT, "\n".join(names), timeout=timeout)
        if status == _TIMEOUT:
            missing = payload.decode().split("\n")
            raise CollectiveTimeout(f"{self._where}: keys {missing} were not set within {timeout:g} s")

    def check(self, keys: Iterable[str]) -> bool:
        return self._call(_CHECK, "\n".join(_key(k) for k in keys))[1] == b"1"

    def delete(self, key: str) -> bool:
        return self._call(_DELETE, _key(key))[1] == b"1"


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
