"""A replacement process joining a running job in the place of a lost rank.

The replacement listens on a free port and says where (``announce``); the live ranks of the
group it joins each dial it (``dial``: the token handshake, then HELLO frames both ways, as
in the mesh of a start) and put the new connection in the place of their link to the lost
rank. The replacement takes their connections (``take``) until every member of the group
it was told of has connected; processes without the token are refused as at a start.
Replacements taken in together connect to each other: each dials those of higher rank.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from ferrodist.core import CollectiveTimeout, FerrodistError, InvalidArgument, ProtocolError
from ferrodist.transport._frames import HELLO, encode_header

from .accept import Gate, Hello, Refusals
from .auth import connect_handshake
from .mesh import read_hello
from .net import connect_with_retry, listen
from .rendezvous import POLL

__all__ = ["dial", "take"]


def dial(address: str, key: bytes, rank: int, world_size: int, peer: int, deadline: float, what: str) -> socket.socket:
    """Connect to the replacement of rank ``peer`` at ``address`` (``host:port``), prove the
    job's token and introduce this rank; the socket, once the replacement introduced itself
    as ``peer`` of a job of ``world_size``."""
    host, _, port = address.rpartition(":")
    sock = connect_with_retry(host, int(port), deadline, what, peer)
    try:
        connect_handshake(sock, key, deadline, what, peer)
        sock.sendall(encode_header(HELLO, rank, 0, world_size, 0))
        claimed, size = read_hello(sock, deadline, what, peer)
    except BaseException:
        sock.close()
        raise
    if (claimed, size) != (peer, world_size):
        sock.close()
        raise ProtocolError(
            f"{what}: the process at {address} introduced itself as rank {claimed} of {size}, not as rank {peer}'s "
            f"replacement in a job of {world_size}"
        )
    return sock


def take(
    host: str,
    key: bytes,
    rank: int,
    world_size: int,
    announce: Callable[[str], None],
    members: Callable[[], Sequence[int] | None],
    deadline: float,
    what: str,
    others: Callable[[], Mapping[int, str]] | None = None,
) -> Iterator[tuple[int, socket.socket]]:
    """Listen on ``host``, ``announce`` the address (``host:port``), and yield ``(peer,
    socket)`` for each rank of the job that dials in, until ``members()`` (None until the
    group is known) have all connected. A process without the token is refused; one that
    introduces itself wrongly, or a second time, is refused too. ``others()``, once the
    group is known: the replacements taken in with this one (rank -> where each listens),
    of which this one dials those of higher rank (the others dial it)."""
    listener = listen(host, 0, what)
    gate = Gate(listener, key, what, Refusals(), hello=True)
    joined: set[int] = set()
    dialed = False
    try:
        announce(f"{host}:{listener.getsockname()[1]}")
        while True:
            group = members()
            if group is not None:
                if rank not in group:
                    raise InvalidArgument(f"{what}: the group this rank was to join ({list(group)}) does not hold it")
                if not dialed and others is not None:
                    dialed = True
                    for other, address in sorted(others().items()):
                        if other > rank and other in group and other not in joined:
                            joined.add(other)
                            yield other, dial(address, key, rank, world_size, other, deadline, what)
                if set(group) - {rank} <= joined:
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(set(group or ()) - joined - {rank})
                raise CollectiveTimeout(
                    f"{what}: {'ranks ' + str(late) + ' did not connect' if group else 'no group took this rank'} "
                    "before the deadline",
                    rank=rank,
                    waiting_for=tuple(late),
                )
            for sock, hello in gate.poll(min(left, POLL)):
                peer = _introduced(sock, hello, rank, world_size, joined)
                if peer is None:
                    continue
                joined.add(peer)
                yield peer, sock
    finally:
        gate.close()
        listener.close()


def _introduced(
    sock: socket.socket, hello: Hello | FerrodistError | None, rank: int, world_size: int, joined: set[int]
) -> int | None:
    """The rank a connection introduced itself as, once answered; None (and closed) when it
    did not, or not as a new member of this job."""
    if not isinstance(hello, Hello) or hello.world_size != world_size or hello.rank in joined:
        sock.close()
        return None
    if not 0 <= hello.rank < world_size or hello.rank == rank:
        sock.close()
        return None
    try:
        sock.sendall(encode_header(HELLO, rank, 0, world_size, 0))
    except OSError:
        sock.close()
        return None
    return hello.rank
