"""The control channel between the launchers of a job of several nodes (see ``_nodes``):
the challenge and response that prove each side holds ``FERRODIST_TOKEN``, the
length-prefixed JSON messages after it, and the ranks' own token derived for a job. The hub
runs every connection's handshake at once: each is a ``Knock`` on a non-blocking socket."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import select
import socket
import struct
import threading
import time

__all__ = [
    "ACCEPT",
    "HANDSHAKE",
    "MAGIC",
    "MOST_KNOCKS",
    "NONCE",
    "REFUSE",
    "Channel",
    "Knock",
    "loopback",
    "proof",
    "rank_token",
    "recv_exact",
]

#: The first bytes each side sends; the challenge's length; seconds a handshake may take.
MAGIC = b"FDL1"
NONCE = 32
HANDSHAKE = 5.0
ACCEPT, REFUSE = b"\x01", b"\x00"
LENGTH = struct.Struct("!I")
MAX_MESSAGE = 16 << 20


def rank_token(token: str, job: str) -> str:
    """The ranks' ``FERRODIST_TOKEN`` for job ``job``, from the token every node was given."""
    return hmac.new(token.encode(), b"ferrodist job " + job.encode(), hashlib.sha256).hexdigest()


def proof(token: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, b"ferrodist launcher " + role + nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return data


class Channel:
    """A connection between two launchers after the handshake: length-prefixed JSON messages."""

    def __init__(self, sock: socket.socket, node: int) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.node = node
        self.heard = time.monotonic()
        self.closed = False
        self._buffer = bytearray()
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, kind: str, **fields: object) -> bool:
        """Send one message (5 s at most); False if the connection is gone."""
        body = json.dumps({"kind": kind, **fields}).encode()
        data = memoryview(LENGTH.pack(len(body)) + body)
        give_up = time.monotonic() + 5.0
        with self._send_lock:
            while data and not self.closed:
                try:
                    data = data[self.sock.send(data) :]
                except BlockingIOError:
                    left = give_up - time.monotonic()
                    if left <= 0:
                        self.closed = True
                        break
                    select.select([], [self.sock], [], left)
                except OSError:
                    self.closed = True
        return not self.closed

    def receive(self) -> list[dict[str, object]]:
        """The messages that have arrived in full (marks the channel closed at its end)."""
        while not self.closed:
            try:
                chunk = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            self.heard = time.monotonic()
            self._buffer += chunk
        messages = []
        while len(self._buffer) >= LENGTH.size:
            (size,) = LENGTH.unpack_from(self._buffer)
            if size > MAX_MESSAGE:
                self.closed = True
                break
            if len(self._buffer) < LENGTH.size + size:
                break
            body = bytes(self._buffer[LENGTH.size : LENGTH.size + size])
            del self._buffer[: LENGTH.size + size]
            try:
                message = json.loads(body)
            except ValueError:
                self.closed = True
                break
            if isinstance(message, dict):
                messages.append(message)
        return messages

    def close(self) -> None:
        self.closed = True
        self.sock.close()


#: Handshakes the hub holds at once; the oldest is dropped for a new one past this.
MOST_KNOCKS = 64


class Knock:
    """A connection to the hub in its handshake: the challenge is sent, the reply comes
    in pieces on a non-blocking socket, and the whole of it must arrive by ``deadline``."""

    REPLY = len(MAGIC) + 32 + NONCE

    def __init__(self, sock: socket.socket, host: str) -> None:
        self.sock, self.host = sock, host
        self.challenge = os.urandom(NONCE)
        self.reply = b""
        self.deadline = time.monotonic() + HANDSHAKE
        sock.setblocking(False)
        sock.send(MAGIC + self.challenge)  # 36 bytes into an empty send buffer

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> bool:
        """Take what has arrived; True once the whole reply is in."""
        try:
            chunk = self.sock.recv(self.REPLY - len(self.reply))
        except (BlockingIOError, InterruptedError):
            return False
        if not chunk:
            raise ConnectionError("it closed the connection during the handshake")
        self.reply += chunk
        if not MAGIC.startswith(self.reply[: len(MAGIC)]):
            raise ConnectionError("it does not speak the launchers' protocol")
        return len(self.reply) == self.REPLY

    def answer(self, token: bytes) -> bool:
        """Once the whole reply is in: accept a member that proved it holds ``token`` (and
        prove that the hub does), or refuse it; True if it was accepted."""
        if not hmac.compare_digest(self.reply[4:36], proof(token, b"member", self.challenge)):
            self.sock.send(REFUSE)
            return False
        self.sock.send(ACCEPT + proof(token, b"hub", self.reply[36:]))
        return True


def loopback(addr: str) -> bool:
    """True if ``addr`` names this host's loopback: listen there only."""
    try:
        return socket.gethostbyname(addr).startswith("127.")
    except OSError:
        return False
