"""Challenge-response authentication of every connection with the job token.

Both ends prove they hold the token without sending it: the server sends a random
nonce, the client answers HMAC-SHA256(token, "client" + nonce) with a nonce of its own,
and the server answers HMAC-SHA256(token, "server" + client nonce). A process without
the token (or with another job's) is refused before any data is exchanged. The token
never appears in a message or an error.

A job without a token (``FERRODIST_TOKEN`` unset, as when ranks are started by hand, by
mpiexec or by SLURM) still runs the handshake, with an empty key that anyone can compute:
it is open to every process that can reach its ports. The first handshake of such a
process logs one WARNING (logger ``ferrodist.transport``) saying so and how to set a token.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import socket
import time

from ferrodist.core import AuthenticationFailed, CollectiveTimeout, ProtocolError

from ._net import HANDSHAKE_LIMIT, recv_exact

__all__ = ["NotFerrodist", "accept_handshake", "connect_handshake", "job_token"]

_MAGIC = b"FDAU"
_NONCE = 32
_ACCEPTED, _REFUSED = b"\x01", b"\x00"


class NotFerrodist(ProtocolError):
    """The other end of a connection does not speak the ferrodist handshake.

    Attributes:
        reason: what it did instead, as a clause ("it sent nothing for 5 s ...").
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def job_token() -> bytes:
    """This process's job token, from ``FERRODIST_TOKEN`` (empty: an open job)."""
    return os.environ.get("FERRODIST_TOKEN", "").encode()


@functools.cache
def _warn_open() -> None:
    """Log, once per process, that this job accepts anyone."""
    logging.getLogger("ferrodist.transport").warning(
        "ferrodist: FERRODIST_TOKEN is not set, so this job's connections are not authenticated: any process "
        "that can reach its ports (rank 0's store at MASTER_ADDR:MASTER_PORT and every rank's own port) can join "
        "it or send it data. Export the same secret on every rank, e.g. "
        "FERRODIST_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))'), "
        "or start the ranks with `ferrodist run`, which makes one per job."
    )


def _mac(token: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, role + nonce, hashlib.sha256).digest()


def _short(deadline: float, limit: float) -> float:
    return min(deadline, time.monotonic() + limit)


def accept_handshake(
    sock: socket.socket, token: bytes, deadline: float, what: str, *, limit: float = HANDSHAKE_LIMIT
) -> None:
    """Server side: check the client's proof, then prove ourselves (within ``limit`` seconds)."""
    if not token:
        _warn_open()
    challenge = os.urandom(_NONCE)
    sock.sendall(_MAGIC + challenge)
    reply = recv_exact(sock, len(_MAGIC) + 32 + _NONCE, _short(deadline, limit), what, peer=-1)
    if reply[:4] != _MAGIC:
        raise NotFerrodist(
            f"{what}: a connection that does not speak the ferrodist handshake was refused",
            reason="it does not speak the ferrodist handshake",
        )
    proof, client_nonce = reply[4:36], reply[36:]
    if not hmac.compare_digest(proof, _mac(token, b"client", challenge)):
        sock.sendall(_REFUSED)
        raise AuthenticationFailed(f"{what}: refused a connection that does not hold this job's token")
    sock.sendall(_ACCEPTED + _mac(token, b"server", client_nonce))


def connect_handshake(
    sock: socket.socket, token: bytes, deadline: float, what: str, peer: int, *, limit: float = HANDSHAKE_LIMIT
) -> None:
    """Client side: answer the challenge, then check the server's proof.

    A ferrodist process sends its challenge as soon as it accepts the connection: when
    none comes within ``limit`` seconds (bounded by ``deadline``), the other end is not
    ferrodist (a program that waits for its client to speak, such as an HTTP server) or is
    stopped, and ``NotFerrodist`` says so. Running out of ``deadline`` first is a
    ``CollectiveTimeout``.
    """
    if not token:
        _warn_open()
    short = _short(deadline, limit)
    try:
        hello = recv_exact(sock, len(_MAGIC) + _NONCE, short, what, peer)
    except CollectiveTimeout:
        if short >= deadline:
            raise
        reason = (
            f"it accepted the connection but sent nothing for {limit:g} s instead of starting the ferrodist handshake"
        )
        raise NotFerrodist(f"{what}: the process at rank {peer}'s address {reason}", reason=reason) from None
    if hello[:4] != _MAGIC:
        reason = f"it answered with {hello[:12]!r}..., which is not the ferrodist handshake"
        raise NotFerrodist(f"{what}: the process at rank {peer}'s address {reason}", reason=reason)
    nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + _mac(token, b"client", hello[4:]) + nonce)
    verdict = recv_exact(sock, 1, short, what, peer)
    if verdict != _ACCEPTED:
        raise AuthenticationFailed(
            f"{what}: rank {peer} refused this process: its FERRODIST_TOKEN is not the job's "
            "(start every rank with the same launcher, or export the same token)"
        )
    proof = recv_exact(sock, 32, short, what, peer)
    if not hmac.compare_digest(proof, _mac(token, b"server", nonce)):
        raise AuthenticationFailed(f"{what}: the process at rank {peer}'s address does not hold this job's token")
