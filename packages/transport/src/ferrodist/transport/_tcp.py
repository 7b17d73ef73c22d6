"""``TcpTransport``: a full mesh of TCP connections, one per pair of ranks.

Rendezvous goes through the store on rank 0: each rank listens on a free port, publishes
``host:port`` there, connects to every lower rank and accepts every higher one. Every
connection is authenticated (``_auth``) and then introduced with a HELLO frame.

Each connection has a receiver thread that reads frames as they come: a frame whose
receive is already posted is read with ``recv_into`` straight into the destination
buffer; one that arrives first is kept until its receive is posted. Because the peer
always reads, a send never waits for the receiver's code to get to its receive, so the
sends and receives of a ring step cannot deadlock on full socket buffers. When a peer
dies, its connection breaks, and every rank waiting on it raises ``PeerLost`` at once.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from ferrodist.core import CollectiveTimeout, FerrodistError, InvalidArgument, PeerLost, ProtocolError

from ._auth import job_token
from ._frames import DATA, GOODBYE, HEADER, decode_header, encode_header
from ._matching import Buffer, as_bytes, check_match, check_peer, check_tag, receive_timeout
from ._net import local_address
from ._protocol import DEFAULT_TIMEOUT
from ._rendezvous import mesh
from ._store import StoreClient, StoreServer

__all__ = ["TcpTransport"]

_SMALL = 64 << 10  # payloads up to this size go out in one write with their header
_BARRIER_TAGS = 0xFFFF << 48  # the transport's own barrier messages use tags from here
_DEFAULT_MAX_FRAME = 16 << 30


class _Done:
    """A send: complete when ``isend`` returns (the bytes are in the kernel's hands)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


_DONE = _Done()


class _Pending:
    __slots__ = ("buf", "claimed", "done", "error", "fingerprint", "tag")

    def __init__(self, buf: Buffer, tag: int, fingerprint: int) -> None:
        self.buf = buf
        self.tag = tag
        self.fingerprint = fingerprint
        self.claimed = False  # the receiver thread is reading into buf
        self.done = False
        self.error: BaseException | None = None


class _Recv:
    """A posted receive; ``wait`` blocks on the transport's condition variable."""

    def __init__(self, transport: TcpTransport, pending: _Pending, src: int) -> None:
        self._t = transport
        self._p = pending
        self._src = src

    def is_completed(self) -> bool:
        return self._p.done

    def wait(self, timeout: float | None = None) -> None:
        self._t._wait_recv(self._p, self._src, self._t.timeout if timeout is None else timeout)


class _Link:
    """The connection to one peer: a send lock and sequence, and a receiver thread."""

    def __init__(self, transport: TcpTransport, peer: int, sock: socket.socket) -> None:
        self.transport = transport
        self.peer = peer
        self.sock = sock
        self.send_lock = threading.Lock()
        self.send_seq = 1  # HELLO was frame 0 in both directions
        self.recv_seq = 1
        self.thread = threading.Thread(
            target=self._receive_loop, name=f"ferrodist-rank{transport.rank}-from{peer}", daemon=True
        )

    # -- receiving (the link's own thread) ----------------------------------------------------
    def _receive_loop(self) -> None:
        t = self.transport
        try:
            while True:
                raw = self._read(memoryview(bytearray(HEADER.size)))
                header = decode_header(raw, expected_sequence=self.recv_seq, max_length=t._max_frame, peer=self.peer)
                self.recv_seq += 1
                if header.kind == GOODBYE:
                    t._lose(
                        self.peer,
                        PeerLost(
                            f"rank {self.peer} closed its transport (it finished, or called destroy_process_group)",
                            peer=self.peer,
                            rank=t.rank,
                        ),
                    )
                    return
                if header.kind != DATA:
                    raise ProtocolError(f"rank {self.peer} sent an unexpected HELLO after the handshake")
                t._deliver(self, header.tag, header.fingerprint, header.length)
        except FerrodistError as exc:
            t._lose(self.peer, exc)
        except OSError as exc:
            t._lose(
                self.peer,
                PeerLost(
                    f"the connection from rank {self.peer} broke ({exc.strerror or exc}): it died or was killed",
                    peer=self.peer,
                    rank=t.rank,
                ),
            )
        except Exception as exc:
            t._lose(self.peer, ProtocolError(f"reading from rank {self.peer} failed: {exc!r}", rank=t.rank))

    def _read(self, view: memoryview) -> memoryview:
        """Fill ``view`` from the socket; raise at end of stream."""
        got, count = 0, len(view)
        while got < count:
            try:
                n = self.sock.recv_into(view[got:], count - got)
            except TimeoutError:
                if self.transport._closing:
                    raise PeerLost("this transport is closing", peer=self.peer) from None
                continue
            if n == 0:
                if self.transport._closing:
                    raise PeerLost("this transport is closing", peer=self.peer)
                raise PeerLost(
                    f"rank {self.peer} went away without closing its transport (it exited, crashed or was killed)",
                    peer=self.peer,
                    rank=self.transport.rank,
                )
            got += n
        return view

    def discard(self, count: int) -> None:
        chunk = memoryview(bytearray(min(count, 1 << 20) or 1))
        while count:
            step = min(count, len(chunk))
            self._read(chunk[:step])
            count -= step

    # -- sending (any thread, one frame at a time) ----------------------------------------------
    def send(self, kind: int, tag: int, fingerprint: int, payload: Buffer | None, timeout: float) -> None:
        nbytes = 0 if payload is None else payload.nbytes
        with self.send_lock:
            header = encode_header(kind, tag, self.send_seq, fingerprint, nbytes)
            self.send_seq += 1
            self.sock.settimeout(timeout)
            if payload is None or nbytes == 0:
                self.sock.sendall(header)
            elif nbytes <= _SMALL:
                self.sock.sendall(header + payload.tobytes())
            else:
                self.sock.sendall(header)
                self.sock.sendall(memoryview(payload))  # type: ignore[arg-type]
            self.sock.settimeout(3600.0)


class TcpTransport:
    """One rank of a job connected to every other rank over TCP. Build it with :meth:`connect`.

    Example (each of two processes)::

        t = TcpTransport.connect(rank=r, world_size=2, master_addr="127.0.0.1", master_port=29500)
        buf = np.arange(4.0)
        if r == 0:
            t.send(buf, dst=1)
        else:
            t.recv(buf, src=0)
    """

    def __init__(self, rank: int, world_size: int, *, timeout: float, max_frame_bytes: int) -> None:
        self._rank = rank
        self._world_size = world_size
        self._timeout = float(timeout)
        self._max_frame = max_frame_bytes
        self._links: dict[int, _Link] = {}
        self._cond = threading.Condition()
        self._posted: dict[tuple[int, int], collections.deque[_Pending]] = collections.defaultdict(collections.deque)
        self._unexpected: dict[tuple[int, int], collections.deque[tuple[bytearray, int]]] = collections.defaultdict(
            collections.deque
        )
        self._lost: dict[int, FerrodistError] = {}
        self._closing = False
        self._barriers = 0
        self._store: StoreClient | None = None
        self._server: StoreServer | None = None

    # -- rendezvous ---------------------------------------------------------------------------
    @classmethod
    def connect(
        cls,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout: float = DEFAULT_TIMEOUT,
        token: bytes | None = None,
        max_frame_bytes: int | None = None,
    ) -> TcpTransport:
        """Join the job: rank 0 hosts the store on ``master_addr:master_port``, every rank
        publishes its own listening address there, and the ranks connect pairwise.

        Raises:
            BackendUnavailable: rank 0 cannot listen on the master port (say, it is in use).
            CollectiveTimeout: a rank did not show up within ``timeout``; names it.
            AuthenticationFailed: a peer (or the store) does not hold this job's token.
        """
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidArgument(
                f"TcpTransport.connect: need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}"
            )
        secret = job_token() if token is None else token
        limit = max_frame_bytes or int(os.environ.get("FERRODIST_MAX_FRAME_BYTES", _DEFAULT_MAX_FRAME))
        self = cls(rank, world_size, timeout=timeout, max_frame_bytes=limit)
        deadline = time.monotonic() + timeout
        what = f"rank {rank}: joining a job of {world_size} ranks through {master_addr}:{master_port}"
        try:
            if rank == 0:
                self._server = StoreServer(
                    "0.0.0.0" if local_address(master_addr) != "127.0.0.1" else "127.0.0.1", master_port, token=secret
                )
            self._store = StoreClient(master_addr, master_port, timeout=timeout, token=secret, rank=rank)
            for peer, sock in mesh(rank, world_size, self._store, local_address(master_addr), secret, deadline, what):
                self._add_link(peer, sock)
        except BaseException:
            self.close()
            raise
        for link in self._links.values():
            link.thread.start()
        return self

    def _add_link(self, peer: int, sock: socket.socket) -> None:
        sock.settimeout(3600.0)
        self._links[peer] = _Link(self, peer, sock)

    # -- identity ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def store(self) -> StoreClient:
        """The job's store (for rendezvous-style coordination)."""
        if self._store is None:
            raise InvalidArgument("this transport has no store")
        return self._store

    def __repr__(self) -> str:
        return f"TcpTransport(rank={self._rank}, world_size={self._world_size})"

    # -- receiving -----------------------------------------------------------------------------
    def _deliver(self, link: _Link, tag: int, fingerprint: int, length: int) -> None:
        """Called by a link's thread for each DATA frame header; reads the payload."""
        key = (link.peer, tag)
        with self._cond:
            queue = self._posted.get(key)
            pending = queue.popleft() if queue else None
            if queue is not None and not queue:
                del self._posted[key]
            if pending is not None:
                pending.claimed = True
        if pending is not None:
            error: BaseException | None = check_match(
                self._rank, link.peer, tag, pending.buf.nbytes, pending.fingerprint, length, fingerprint
            )
            try:
                if error is None:
                    if length:
                        link._read(memoryview(pending.buf))  # type: ignore[arg-type]
                else:
                    link.discard(length)
            except BaseException as exc:
                error = exc
                raise
            finally:
                with self._cond:
                    pending.error = error
                    pending.done = True
                    self._cond.notify_all()
            return
        payload = bytearray(length)
        if length:
            link._read(memoryview(payload))
        with self._cond:
            queue = self._posted.get(key)
            if queue:  # its receive was posted while the bytes were arriving
                self._fill(queue.popleft(), link.peer, payload, fingerprint)
                if not queue:
                    del self._posted[key]
                self._cond.notify_all()
            else:
                self._unexpected[key].append((payload, fingerprint))

    def _fill(self, pending: _Pending, src: int, payload: bytearray, fingerprint: int) -> None:
        pending.error = check_match(
            self._rank, src, pending.tag, pending.buf.nbytes, pending.fingerprint, len(payload), fingerprint
        )
        if pending.error is None and payload:
            pending.buf[...] = np.frombuffer(payload, np.uint8)
        pending.done = True

    def irecv(self, buf: Buffer, src: int, tag: int = 0, *, fingerprint: int = 0) -> _Recv:
        src = check_peer(self._rank, self._world_size, src, "recv")
        tag = check_tag(tag, "recv")
        pending = _Pending(as_bytes(buf, "recv", writeable=True, rank=self._rank), tag, fingerprint)
        key = (src, tag)
        with self._cond:
            arrived = self._unexpected.get(key)
            if arrived:
                self._fill(pending, src, *arrived.popleft())
                if not arrived:
                    del self._unexpected[key]
            else:
                self._posted[key].append(pending)
        return _Recv(self, pending, src)

    def recv(self, buf: Buffer, src: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0) -> None:
        self.irecv(buf, src, tag, fingerprint=fingerprint).wait(timeout)

    def _wait_recv(self, pending: _Pending, src: int, limit: float) -> None:
        deadline = time.monotonic() + limit
        with self._cond:
            while not pending.done:
                lost = self._lost.get(src) or self._lost.get(self._rank)
                if lost is not None and not pending.claimed:
                    self._withdraw(pending, src)
                    raise _fresh(lost, f"rank {self._rank} was waiting for a message from rank {src}")
                left = deadline - time.monotonic()
                if left <= 0:
                    if not pending.claimed:
                        self._withdraw(pending, src)
                    raise receive_timeout(self._rank, src, pending.tag, limit)
                self._cond.wait(left)
        if pending.error is not None:
            raise pending.error

    def _withdraw(self, pending: _Pending, src: int) -> None:
        queue = self._posted.get((src, pending.tag))
        if queue is not None and pending in queue:
            queue.remove(pending)

    def _lose(self, peer: int, error: FerrodistError) -> None:
        """Record that ``peer`` is gone (or its stream is corrupt) and wake every waiter."""
        with self._cond:
            self._lost.setdefault(peer, error)
            self._cond.notify_all()

    # -- sending -------------------------------------------------------------------------------
    def isend(
        self, buf: Buffer, dst: int, tag: int = 0, *, fingerprint: int = 0, timeout: float | None = None
    ) -> _Done:
        dst = check_peer(self._rank, self._world_size, dst, "send")
        tag = check_tag(tag, "send")
        payload = as_bytes(buf, "send")
        lost = self._lost.get(dst) or self._lost.get(self._rank)
        if lost is not None:
            raise _fresh(lost, f"rank {self._rank} cannot send to rank {dst}")
        link = self._links[dst]
        limit = self._timeout if timeout is None else timeout
        try:
            link.send(DATA, tag, fingerprint, payload, limit)
        except TimeoutError:
            stalled = CollectiveTimeout(
                f"rank {self._rank} could not hand {payload.nbytes} bytes to rank {dst} within {limit:g} s: "
                f"rank {dst} is not reading (stopped or overloaded)",
                rank=self._rank,
                waiting_for=(dst,),
            )
            self._lose(dst, stalled)  # a frame was cut in the middle: this connection is unusable now
            raise stalled from None
        except OSError as exc:
            error = PeerLost(
                f"rank {self._rank} cannot send to rank {dst}: the connection broke "
                f"({exc.strerror or exc}); it died or was killed",
                peer=dst,
                rank=self._rank,
            )
            self._lose(dst, error)
            raise error from None
        return _DONE

    def send(self, buf: Buffer, dst: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0) -> None:
        self.isend(buf, dst, tag, fingerprint=fingerprint, timeout=timeout)

    # -- whole world ---------------------------------------------------------------------------
    def barrier(self, *, timeout: float | None = None) -> None:
        """Dissemination barrier over every rank (log2 p rounds of one-byte messages)."""
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        tag = _BARRIER_TAGS | self._barriers
        self._barriers += 1
        token, incoming = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
        distance = 1
        while distance < self._world_size:
            to, frm = (self._rank + distance) % self._world_size, (self._rank - distance) % self._world_size
            request = self.irecv(incoming, frm, tag)
            self.isend(token, to, tag, timeout=max(0.001, deadline - time.monotonic()))
            request.wait(max(0.001, deadline - time.monotonic()))
            distance <<= 1

    def close(self) -> None:
        """Say goodbye to every peer and close the connections (and the store on rank 0). Idempotent."""
        if self._closing:
            return
        self._closing = True
        for link in list(self._links.values()):
            try:
                if link.peer not in self._lost:
                    link.send(GOODBYE, 0, 0, None, 1.0)
                link.sock.shutdown(socket.SHUT_RDWR)  # the goodbye still goes out; our reader wakes up
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for link in self._links.values():
            if link.thread.is_alive():
                link.thread.join(max(0.0, deadline - time.monotonic()))
            link.sock.close()
        self._lose(self._rank, PeerLost(f"rank {self._rank}: this transport is closed", peer=self._rank))
        if self._store is not None:
            self._store.close()
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fresh(error: FerrodistError, context: str) -> FerrodistError:
    """A new exception carrying a recorded error's class and attributes, for one more waiter."""
    return error.with_context(context)
