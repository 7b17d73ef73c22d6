"""Taking connections on a listening port: every handshake at once, each with its own limit.

A ``Gate`` accepts what comes to its listener and runs the handshakes (the token challenge,
then, for a peer of the mesh, its HELLO frame) side by side in the one thread that calls
``poll``, on non-blocking sockets. A connection that stays silent or answers slowly holds
nothing but itself and is dropped at its own limit, so a process without the token (or a
port scanner) never delays the job's own connections, however many connections it opens.
Such a process answers within milliseconds when it is ferrodist.

``Refusals`` counts what was refused, by address and reason, so that a start that fails
can say that processes outside the job were knocking, and from where.
"""

from __future__ import annotations

import collections
import errno
import os
import select
import socket
import threading
import time
from dataclasses import dataclass

from ferrodist.core import FerrodistError, ProtocolError
from ferrodist.transport._frames import HEADER, HELLO, decode_header

from .auth import Challenge, NotFerrodist
from .net import HANDSHAKE_LIMIT, tune

__all__ = ["Gate", "Hello", "Refusals"]

#: Handshakes a gate holds at once; the oldest is dropped for a new one past this (a job's
#: own connections finish theirs in milliseconds, so the oldest is a stranger's).
MOST_PENDING = 256

_SILENT = "silent"
_FOREIGN = "foreign"
_NO_TOKEN = "token"
_LEFT = "left"
_REASONS = {
    _NO_TOKEN: "without this job's token",
    _FOREIGN: "that does not speak ferrodist",
    _SILENT: "that stayed silent past the handshake limit",
    _LEFT: "that closed during the handshake",
}


class Refusals:
    """Connections refused by a rank's ports (its store, its own listener), by address and
    reason; safe to share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()
        #: Connections still in their handshake when the last gate closed (never refused, never let in).
        self.pending_at_end = 0
        self._pending_hosts: collections.Counter[str] = collections.Counter()

    def add(self, host: str, reason: str) -> None:
        with self._lock:
            self._counts[(host, reason)] += 1

    def unfinished(self, hosts: list[str]) -> None:
        """``hosts`` were still in their handshakes when a gate closed."""
        with self._lock:
            self.pending_at_end = len(hosts)
            self._pending_hosts = collections.Counter(hosts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def describe(self, who: str) -> str:
        """A clause for an error message: what ``who`` (these ports' rank) refused, from where;
        '' when nothing was."""
        with self._lock:
            counts, pending = dict(self._counts), dict(self._pending_hosts)
        if not counts and not pending:
            return ""
        parts = []
        if counts:
            by_reason: collections.Counter[str] = collections.Counter()
            hosts: collections.Counter[str] = collections.Counter()
            for (host, reason), n in counts.items():
                by_reason[reason] += n
                hosts[host] += n
            reasons = ", ".join(f"{n} {_REASONS[r]}" for r, n in sorted(by_reason.items(), key=lambda x: -x[1]))
            total = sum(counts.values())
            parts.append(f"refused {total} connection{'s' if total != 1 else ''} ({reasons}) from {_hosts(hosts)}")
        if pending:
            total, where = sum(pending.values()), _hosts(collections.Counter(pending))
            if counts:
                parts.append(f"{total} more from {where} {'was' if total == 1 else 'were'} still silent")
            else:
                parts.append(f"had {total} connection{'s' if total != 1 else ''} from {where} still silent")
        return (
            f"; meanwhile {who} "
            + " and ".join(parts)
            + ": processes outside the job are connecting to its ports (those without the job's FERRODIST_TOKEN "
            "are refused; a firewall keeps other hosts away)"
        )


def _hosts(counts: collections.Counter[str]) -> str:
    shown = [f"{host}" + (f" ({n})" if len(counts) > 1 else "") for host, n in counts.most_common(8)]
    more = len(counts) - len(shown)
    return ", ".join(shown) + (f" and {more} more addresses" if more > 0 else "")


@dataclass(frozen=True)
class Hello:
    """What a peer's HELLO said: the rank it claims and its world size."""

    rank: int
    world_size: int


class _Pending:
    __slots__ = ("address", "challenge", "deadline", "got", "sock", "stage")

    def __init__(self, sock: socket.socket, address: str, challenge: Challenge, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.challenge = challenge
        self.deadline = deadline
        self.stage = 0  # 0: reading the client's proof; 1: reading its HELLO
        self.got = bytearray()


class Gate:
    """Accepts on ``listener`` and runs every handshake at once (see the module docstring).

    Args:
        listener: a listening socket (made non-blocking here).
        token: the job's secret.
        what: for messages, what this port is.
        refusals: where refused connections are counted.
        hello: read the peer's HELLO frame after the token handshake (the mesh), or not
            (the store).
        limit: seconds each connection has for its handshake, from its accept.
    """

    def __init__(
        self,
        listener: socket.socket,
        token: bytes,
        what: str,
        refusals: Refusals,
        *,
        hello: bool,
        limit: float = HANDSHAKE_LIMIT,
    ) -> None:
        self._listener = listener
        listener.setblocking(False)
        self._token = token
        self._what = what
        self._refusals = refusals
        self._hello = hello
        self._limit = limit
        self._pending: dict[int, _Pending] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        """Make a ``poll`` in another thread return now."""
        with self._lock:
            if not self._closed:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass

    def poll(self, timeout: float | None) -> list[tuple[socket.socket, Hello | FerrodistError | None]]:
        """Wait up to ``timeout`` seconds (``None``: until something happens) and advance every
        handshake. Returns the connections that got through: each socket (blocking again) with
        the peer's ``Hello``, or ``None`` without one (the store), or the error of a process that
        holds the token but did not introduce itself."""
        wait = timeout
        if self._pending:
            first = min(p.deadline for p in self._pending.values()) - time.monotonic()
            wait = max(0.0, first if timeout is None else min(timeout, first))
        poller = select.poll()
        poller.register(self._listener.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        for fd in self._pending:
            poller.register(fd, select.POLLIN)
        events = poller.poll(None if wait is None else wait * 1000 + 1)
        done: list[tuple[socket.socket, Hello | FerrodistError | None]] = []
        for fd, _ in events:
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 64)
                except OSError:
                    pass
            elif fd == self._listener.fileno():
                self._accept_all()
            elif fd in self._pending:
                result = self._advance(self._pending[fd])
                if result is not None:
                    done.append(result)
        now = time.monotonic()
        for fd, pending in list(self._pending.items()):
            if now >= pending.deadline:
                self._drop(fd, _SILENT)
        return done

    def close(self) -> None:
        """Close the connections still in their handshakes (``Refusals.unfinished``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._refusals.unfinished([p.address for p in self._pending.values()])
        for pending in self._pending.values():
            pending.sock.close()
        self._pending.clear()

    # -- one connection at a time, never waiting ----------------------------------------------------
    def _accept_all(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):  # out of descriptors: free the oldest
                    if self._pending:
                        self._drop(min(self._pending, key=lambda fd: self._pending[fd].deadline), _SILENT)
                    else:
                        time.sleep(0.05)  # the listener stays readable: do not spin on it
                return  # (or the listener was closed: the caller stops)
            host = str(address[0])
            try:
                tune(sock)
                sock.setblocking(False)
                challenge = Challenge(self._token)
                if sock.send(challenge.greeting) != len(challenge.greeting):
                    raise BlockingIOError
            except OSError:
                sock.close()
                self._refusals.add(host, _LEFT)
                continue
            if len(self._pending) >= MOST_PENDING:
                oldest = min(self._pending, key=lambda fd: self._pending[fd].deadline)
                self._drop(oldest, _SILENT)
            self._pending[sock.fileno()] = _Pending(sock, host, challenge, time.monotonic() + self._limit)

    def _advance(self, p: _Pending) -> tuple[socket.socket, Hello | FerrodistError | None] | None:
        fd = p.sock.fileno()
        need = Challenge.REPLY if p.stage == 0 else HEADER.size
        try:
            part = p.sock.recv(need - len(p.got))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            part = b""
        if not part:
            if p.stage == 1:  # it holds the token: a member of the job that did not introduce itself
                return self._let_in(fd, ProtocolError(f"{self._what}: it closed the connection instead"))
            self._drop(fd, _LEFT)
            return None
        p.got += part
        if len(p.got) < need:
            return None
        if p.stage == 0:
            try:
                accepted, response = p.challenge.answer(bytes(p.got), self._what)
            except NotFerrodist:
                self._drop(fd, _FOREIGN)
                return None
            try:
                p.sock.send(response)
            except OSError:
                accepted = False
            if not accepted:
                self._drop(fd, _NO_TOKEN)
                return None
            if not self._hello:
                return self._let_in(fd, None)
            p.stage, p.got = 1, bytearray()
            return None
        try:
            header = decode_header(bytes(p.got), expected_sequence=0, max_length=0, peer=-1)
            if header.kind != HELLO:
                raise ProtocolError(f"{self._what}: the first frame of a connection was not a HELLO")
        except ProtocolError as exc:
            return self._let_in(fd, exc)
        return self._let_in(fd, Hello(header.tag, header.fingerprint))

    def _let_in(
        self, fd: int, result: Hello | FerrodistError | None
    ) -> tuple[socket.socket, Hello | FerrodistError | None]:
        p = self._pending.pop(fd)
        p.sock.setblocking(True)
        p.sock.settimeout(HANDSHAKE_LIMIT)
        return p.sock, result

    def _drop(self, fd: int, reason: str) -> None:
        p = self._pending.pop(fd)
        p.sock.close()
        self._refusals.add(p.address, reason)
