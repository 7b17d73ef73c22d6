"""Building the full mesh: every pair of ranks gets one authenticated, introduced connection.

Each rank listens on a free port of its chosen address, publishes ``host:port`` in the
store, connects to every lower rank and accepts every higher one. Connections only go
downward, so no two ranks wait on each other. After the token handshake, both ends send
a HELLO frame (frame 0) carrying their rank and the world size.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

from ferrodist.core import CollectiveTimeout, FerrodistError, ProtocolError

from ._auth import accept_handshake, connect_handshake
from ._frames import HEADER, HELLO, decode_header, encode_header
from ._net import connect_with_retry, listen, recv_exact, tune
from ._store import StoreClient

__all__ = ["mesh"]


def mesh(
    rank: int, world_size: int, store: StoreClient, host: str, secret: bytes, deadline: float, what: str
) -> Iterator[tuple[int, socket.socket]]:
    """Yield ``(peer, socket)`` for every other rank; every socket is authenticated and
    introduced. On failure the sockets not yet yielded are closed."""
    listener = listen(host, 0, what)
    try:
        store.set(f"ferrodist/addr/{rank}", f"{host}:{listener.getsockname()[1]}")
        for peer in range(rank):
            yield peer, _dial(rank, world_size, peer, store, secret, deadline, what)
        yield from _accept_all(rank, world_size, listener, secret, deadline, what)
    finally:
        listener.close()


def _dial(
    rank: int, world_size: int, peer: int, store: StoreClient, secret: bytes, deadline: float, what: str
) -> socket.socket:
    try:
        address = store.get(f"ferrodist/addr/{peer}", timeout=max(0.0, deadline - time.monotonic()))
    except CollectiveTimeout:
        raise CollectiveTimeout(
            f"{what}: rank {peer} never published its address (is it running?)", rank=rank, waiting_for=(peer,)
        ) from None
    host, _, port = address.decode().rpartition(":")
    sock = connect_with_retry(host, int(port), deadline, what, peer)
    try:
        connect_handshake(sock, secret, deadline, what, peer)
        sock.sendall(encode_header(HELLO, rank, 0, world_size, 0))
        _check_hello(rank, world_size, sock, deadline, what, expect=peer)
    except BaseException:
        sock.close()
        raise
    return sock


def _accept_all(
    rank: int, world_size: int, listener: socket.socket, secret: bytes, deadline: float, what: str
) -> Iterator[tuple[int, socket.socket]]:
    waiting = set(range(rank + 1, world_size))
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(
                f"{what}: ranks {sorted(waiting)} never connected to rank {rank}",
                rank=rank,
                waiting_for=tuple(sorted(waiting)),
            )
        listener.settimeout(min(left, 1.0))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        tune(sock)
        try:
            accept_handshake(sock, secret, deadline, what)
            peer = _check_hello(rank, world_size, sock, deadline, what, expect=None)
            if peer not in waiting:
                raise ProtocolError(f"{what}: a second connection claims to be rank {peer}")
            sock.sendall(encode_header(HELLO, rank, 0, world_size, 0))
        except FerrodistError:
            sock.close()  # a stranger or a refused process: keep waiting for the real peers
            continue
        waiting.discard(peer)
        yield peer, sock


def _check_hello(
    rank: int, world_size: int, sock: socket.socket, deadline: float, what: str, expect: int | None
) -> int:
    who = -1 if expect is None else expect
    hello = decode_header(
        recv_exact(sock, HEADER.size, deadline, what, who), expected_sequence=0, max_length=0, peer=who
    )
    peer, size = hello.tag, hello.fingerprint
    if hello.kind != HELLO or size != world_size or not 0 <= peer < size or peer == rank:
        raise ProtocolError(
            f"{what}: a peer introduced itself as rank {peer} of {size}; this job has {world_size} ranks"
        )
    if expect is not None and peer != expect:
        raise ProtocolError(f"{what}: rank {expect}'s address is now used by rank {peer}")
    return peer
