"""The full mesh of a starting job: every rank listens on a free port of the address the job
uses, publishes ``host:port`` in the store, connects to every lower rank and accepts every
higher one (connections only go downward, so no two ranks wait on each other). After the
token handshake both ends send a HELLO frame (frame 0) with their rank and world size.

A rank takes connections through a ``Gate`` (``accept``): every handshake runs at once,
each with its own limit, so connections from processes outside the job (silent, speaking
something else, without the token) never hold up the job's own; they are counted in the
rank's ``Refusals``. A process that holds the token but contradicts the job (its HELLO)
aborts the start on every rank (``Rendezvous.abort``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

from ferrodist.core import CollectiveTimeout, FerrodistError, InvalidArgument, PeerLost, ProtocolError
from ferrodist.transport._frames import HEADER, HELLO, decode_header, encode_header

from .accept import Gate, Hello, Refusals
from .auth import connect_handshake
from .net import HANDSHAKE_LIMIT, connect_with_retry, listen, readable, recv_exact
from .rendezvous import POLL, Rendezvous

__all__ = ["mesh"]


def mesh(rdv: Rendezvous, host: str, secret: bytes, refusals: Refusals) -> Iterator[tuple[int, socket.socket]]:
    """Yield ``(peer, socket)`` for every other rank; every socket is authenticated and
    introduced. On failure the sockets not yet yielded are closed."""
    listener = listen(host, 0, rdv.what)
    try:
        rdv.store.set(f"ferrodist/addr/{rdv.rank}", f"{host}:{listener.getsockname()[1]}", timeout=rdv.left())
        for peer in range(rdv.rank):
            yield peer, _dial(rdv, peer, secret)
        yield from _accept_all(rdv, listener, secret, refusals)
    finally:
        listener.close()


def _dial(rdv: Rendezvous, peer: int, secret: bytes) -> socket.socket:
    address = rdv.get(f"ferrodist/addr/{peer}", peer, "published its address (is it running?)")
    host, _, port = address.decode().rpartition(":")
    sock = connect_with_retry(host, int(port), rdv.deadline, rdv.what, peer)
    try:
        # The peer accepts once it has connected to the ranks below it, which may take
        # long (one of them has not started yet): meanwhile, look for an abort.
        while not readable(sock, min(POLL, rdv.deadline - time.monotonic())):
            if rdv.expired():
                raise CollectiveTimeout(
                    f"{rdv.what}: rank {peer} did not take this rank's connection in time (it is still connecting "
                    "to a rank below it?)",
                    rank=rdv.rank,
                    waiting_for=(peer,),
                )
            rdv.check()
        try:
            connect_handshake(sock, secret, rdv.deadline, rdv.what, peer)
            sock.sendall(encode_header(HELLO, rdv.rank, 0, rdv.world_size, 0))
            claimed, size = read_hello(sock, rdv.deadline, rdv.what, peer)
        except (PeerLost, ProtocolError) as exc:  # the peer refused our HELLO, perhaps
            rdv.check_after(exc)
    except BaseException:
        sock.close()
        raise
    if (claimed, size) != (peer, rdv.world_size):
        sock.close()
        rdv.abort(
            InvalidArgument(
                f"the process at rank {peer}'s address introduced itself as rank {claimed} of a job of {size} ranks, "
                f"to rank {rdv.rank} of a job of {rdv.world_size}: start every rank with the same WORLD_SIZE and its "
                "own RANK"
            )
        )
    return sock


def _accept_all(
    rdv: Rendezvous, listener: socket.socket, secret: bytes, refusals: Refusals
) -> Iterator[tuple[int, socket.socket]]:
    rank, world_size = rdv.rank, rdv.world_size
    waiting = set(range(rank + 1, world_size))
    gate = Gate(listener, secret, rdv.what, refusals, hello=True)
    arrived: list[tuple[socket.socket, Hello | FerrodistError | None]] = []
    try:
        while waiting:
            left = rdv.deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeout(
                    f"{rdv.what}: ranks {sorted(waiting)} never connected to rank {rank}",
                    rank=rank,
                    waiting_for=tuple(sorted(waiting)),
                )
            rdv.check_due()
            arrived = gate.poll(min(left, POLL))
            while arrived:
                sock, hello = arrived.pop(0)
                peer = _introduced(rdv, sock, hello, waiting)  # a process holding the job's token: it must fit
                waiting.discard(peer)
                yield peer, sock
    finally:
        for sock, _ in arrived:
            sock.close()
        gate.close()


def _introduced(rdv: Rendezvous, sock: socket.socket, hello: Hello | FerrodistError | None, waiting: set[int]) -> int:
    """The peer that ``sock`` (through the token handshake) introduced itself as, after
    answering its HELLO; the start is aborted when it did not introduce itself, or when what
    it says contradicts the job."""
    rank, world_size = rdv.rank, rdv.world_size
    if not isinstance(hello, Hello):
        sock.close()
        rdv.abort(
            ProtocolError(
                f"a process of this job connected to rank {rank} but did not introduce itself "
                f"({hello if hello is not None else 'it sent no HELLO'})"
            )
        )
    problem = _hello_problem(rank, world_size, waiting, hello.rank, hello.world_size)
    if problem is not None:
        sock.close()
        rdv.abort(InvalidArgument(problem))
    try:
        sock.sendall(encode_header(HELLO, rank, 0, world_size, 0))
    except OSError as exc:
        sock.close()
        rdv.abort(ProtocolError(f"a process of this job connected to rank {rank} but left before its HELLO ({exc})"))
    return hello.rank


def _hello_problem(rank: int, world_size: int, waiting: set[int], peer: int, size: int) -> str | None:
    """What is wrong with a HELLO from ``peer`` of a job of ``size`` ranks, if anything."""
    if size != world_size:
        return (
            f"rank {peer} was started with WORLD_SIZE={size} and rank {rank} with WORLD_SIZE={world_size}: "
            "start every rank with the same WORLD_SIZE"
        )
    if peer in waiting:
        return None
    if rank < peer < world_size:
        return f"two processes were started as rank {peer} (both connected to rank {rank}): give each its own RANK"
    return (
        f"a process introduced itself to rank {rank} as rank {peer}, but only ranks {rank + 1} to {world_size - 1} "
        f"connect to rank {rank}: two processes were started as rank {peer}, or RANK is wrong"
    )


def read_hello(sock: socket.socket, deadline: float, what: str, who: int) -> tuple[int, int]:
    """The rank and world size a peer's HELLO claims (within the handshake limit)."""
    short = min(deadline, time.monotonic() + HANDSHAKE_LIMIT)
    hello = decode_header(recv_exact(sock, HEADER.size, short, what, who), expected_sequence=0, max_length=0, peer=who)
    if hello.kind != HELLO:
        raise ProtocolError(f"{what}: the first frame of a connection was not a HELLO")
    return hello.tag, hello.fingerprint
