"""Sockets with deadlines: exact reads, connecting with retries, choosing the local address."""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import select
import socket
import struct
import time

from ferrodist.core import BackendUnavailable, CollectiveTimeout, InvalidArgument, PeerLost

__all__ = [
    "HANDSHAKE_LIMIT",
    "PortInUse",
    "connect_with_retry",
    "listen",
    "local_address",
    "readable",
    "recv_exact",
    "remaining",
    "store_address",
]

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface
_FIRST_PIECE = 64 << 10

#: Seconds a connection's handshake (token exchange, HELLO) may take once its other end
#: has started it: a ferrodist process answers at once, so a longer silence means the
#: other end is not ferrodist (or is stopped).
HANDSHAKE_LIMIT = 5.0


class PortInUse(BackendUnavailable):
    """``listen`` found the port taken (``EADDRINUSE``); a ``BackendUnavailable`` to callers."""


def remaining(deadline: float, what: str) -> float:
    """Seconds left before ``deadline``; ``CollectiveTimeout`` if none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise CollectiveTimeout(f"{what}: ran out of time")
    return left


def recv_exact(sock: socket.socket, count: int, deadline: float, what: str, peer: int) -> bytes:
    """Read exactly ``count`` bytes before ``deadline`` (``PeerLost`` on end of stream).

    Memory grows with the bytes that arrive (64 KiB, then at most as much again as has
    come), never with ``count`` alone: a length read from the wire reserves nothing."""
    buf = bytearray()
    while len(buf) < count:
        sock.settimeout(remaining(deadline, what))
        try:
            part = sock.recv(min(count - len(buf), max(_FIRST_PIECE, len(buf))))
        except TimeoutError:
            raise CollectiveTimeout(f"{what}: no answer from rank {peer} in time", waiting_for=(peer,)) from None
        except OSError as exc:
            raise PeerLost(f"{what}: the connection to rank {peer} failed ({exc})", peer=peer) from None
        if not part:
            raise PeerLost(f"{what}: rank {peer} closed the connection", peer=peer)
        buf += part
    return bytes(buf)


def readable(sock: socket.socket, seconds: float) -> bool:
    """Whether ``sock`` has bytes (or an end of stream) to read within ``seconds``."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(max(0.0, seconds) * 1000))


def tune(sock: socket.socket) -> None:
    """Low latency and keep-alive probes, so a vanished host is noticed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def connect_with_retry(
    host: str, port: int, deadline: float, what: str, peer: int, *, retry: bool = True
) -> socket.socket:
    """Connect to ``host:port``, retrying with backoff until ``deadline``.

    On failure the error lists every address tried and why each failed. With
    ``retry=False`` (reconnecting to something that was there) one round of attempts is
    made, and a refusal is ``PeerLost``: the other end has gone.
    """
    delay = 0.02
    tried: dict[str, str] = {}
    while True:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            tried[host] = f"name lookup failed: {exc}"
            infos = []
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(max(0.05, min(2.0, deadline - time.monotonic())))
                sock.connect(address)
            except OSError as exc:
                sock.close()
                tried[f"{address[0]!s}:{address[1]!s}"] = exc.strerror or type(exc).__name__
                continue
            tune(sock)
            return sock
        if not retry and tried:
            attempts = "; ".join(f"{addr}: {why}" for addr, why in tried.items())
            raise PeerLost(
                f"{what}: rank {peer} at {host}:{port} no longer accepts connections ({attempts}): "
                "it exited or closed its transport",
                peer=peer,
            )
        if time.monotonic() + delay > deadline:
            attempts = "; ".join(f"{addr}: {why}" for addr, why in tried.items()) or "no address"
            raise CollectiveTimeout(
                f"{what}: could not connect to rank {peer} at {host}:{port} before the deadline "
                f"(tried {attempts}); is it running, and is the address reachable from here?",
                waiting_for=(peer,),
            )
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def listen(host: str, port: int, what: str) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # Two processes may both bind a port with SO_REUSEADDR while neither listens yet:
        # the second one learns that the port is taken here.
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"{what}: port {port} on {host} is already in use (another job, or one that has not exited); "
                "choose another with MASTER_PORT or `ferrodist run --master-port`"
            ) from None
        raise BackendUnavailable(f"{what}: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:
        names = ", ".join(n for _, n in socket.if_nameindex())
        raise InvalidArgument(
            f"FERRODIST_SOCKET_IFNAME={name!r}: no IPv4 address on that interface (interfaces here: {names})"
        ) from None
    finally:
        probe.close()
    return socket.inet_ntoa(packed[20:24])


def store_address(master_addr: str) -> str:
    """The address rank 0's store listens on: the one ``master_addr`` names, where this
    host has it (that is where the other ranks connect: a host name that resolves to a
    loopback address such as 127.0.1.1 included), else the address of the interface that
    routes to it (a master address that is translated on its way here). Never every
    address of the host."""
    if ":" in master_addr:  # an IPv6 literal: listen on it as it is
        return master_addr
    try:
        resolved = socket.gethostbyname(master_addr)
    except OSError:
        return local_address(master_addr)
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.bind((resolved, 0))  # succeeds only for an address of this host
        return resolved
    except OSError:
        return local_address(master_addr)
    finally:
        probe.close()


def local_address(master_addr: str) -> str:
    """The address this host's peers should use to reach it.

    ``FERRODIST_SOCKET_IFNAME`` names the interface; otherwise loopback when the master
    is on loopback, else the address of the interface that routes to the master.
    """
    ifname = os.environ.get("FERRODIST_SOCKET_IFNAME")
    if ifname:
        return interface_address(ifname)
    try:
        if ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master_addr, 9))  # no packet is sent: this only asks for a route
        return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()
