"""Challenge-response authentication of every connection with the job token.

Both ends prove they hold the token without sending it: the server sends a random
nonce, the client answers HMAC-SHA256(token, "client" + nonce) with a nonce of its own,
and the server answers HMAC-SHA256(token, "server" + client nonce). A process without
the token (or with another job's) is refused before any data is exchanged. The token
never appears in a message or an error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from ferrodist.core import AuthenticationFailed, ProtocolError

from ._net import recv_exact

__all__ = ["accept_handshake", "connect_handshake", "job_token"]

_MAGIC = b"FDAU"
_NONCE = 32
_ACCEPTED, _REFUSED = b"\x01", b"\x00"


def job_token() -> bytes:
    """This process's job token, from ``FERRODIST_TOKEN`` (empty: an open job)."""
    return os.environ.get("FERRODIST_TOKEN", "").encode()


def _mac(token: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, role + nonce, hashlib.sha256).digest()


def accept_handshake(sock: socket.socket, token: bytes, deadline: float, what: str) -> None:
    """Server side: check the client's proof, then prove ourselves."""
    challenge = os.urandom(_NONCE)
    sock.sendall(_MAGIC + challenge)
    reply = recv_exact(sock, len(_MAGIC) + 32 + _NONCE, deadline, what, peer=-1)
    if reply[:4] != _MAGIC:
        raise ProtocolError(f"{what}: a connection that does not speak the ferrodist handshake was refused")
    proof, client_nonce = reply[4:36], reply[36:]
    if not hmac.compare_digest(proof, _mac(token, b"client", challenge)):
        sock.sendall(_REFUSED)
        raise AuthenticationFailed(f"{what}: refused a connection that does not hold this job's token")
    sock.sendall(_ACCEPTED + _mac(token, b"server", client_nonce))


def connect_handshake(sock: socket.socket, token: bytes, deadline: float, what: str, peer: int) -> None:
    """Client side: answer the challenge, then check the server's proof."""
    hello = recv_exact(sock, len(_MAGIC) + _NONCE, deadline, what, peer)
    if hello[:4] != _MAGIC:
        raise ProtocolError(f"{what}: rank {peer}'s address answered with something that is not ferrodist")
    nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + _mac(token, b"client", hello[4:]) + nonce)
    verdict = recv_exact(sock, 1, deadline, what, peer)
    if verdict != _ACCEPTED:
        raise AuthenticationFailed(
            f"{what}: rank {peer} refused this process: its FERRODIST_TOKEN is not the job's "
            "(start every rank with the same launcher, or export the same token)"
        )
    proof = recv_exact(sock, 32, deadline, what, peer)
    if not hmac.compare_digest(proof, _mac(token, b"server", nonce)):
        raise AuthenticationFailed(f"{what}: the process at rank {peer}'s address does not hold this job's token")
