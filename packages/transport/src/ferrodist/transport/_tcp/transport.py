"""``TcpTransport``: a full mesh of TCP connections, one per pair of ranks.

Rendezvous goes through the store on rank 0: each rank listens on a free port, publishes
``host:port`` there, connects to every lower rank and accepts every higher one. Every
connection is authenticated (``auth``) and then introduced with a HELLO frame. Without a
secret (no ``FERRODIST_TOKEN``, none from the launcher) a job listens on loopback only, and
one across hosts is refused.

Each connection is a ``Link`` that owns everything of its peer, and has a receiver thread
that reads frames as they come: a frame whose receive is already posted is read with
``recv_into`` straight into the destination buffer; one that arrives first is kept, in
pieces allocated as its bytes come, until its receive is posted (a receive posted while it
arrives checks its size at once). Because the peer always reads, a send never waits for
the receiver's code to get to its receive, so the sends and receives of a ring step cannot
deadlock on full socket buffers. When a peer dies, its connection breaks, and every rank
waiting on it raises ``PeerLost`` at once.

The transport checks each call's arguments and hands it to the link of its peer; what the
links share (``Context``) it hands them when they are made. It also starts the job, sends
the abort notices and goodbyes, and runs the barrier.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ferrodist.core import AuthenticationFailed, FerrodistError, InvalidArgument, PeerLost
from ferrodist.transport._aborts import Notice, encode_notice
from ferrodist.transport._checks import (
    Buffer,
    as_bytes,
    check_peer,
    check_sources,
    check_tag,
)
from ferrodist.transport._cores import yields_for
from ferrodist.transport._frames import ABORT, GOODBYE
from ferrodist.transport._protocol import DEFAULT_TIMEOUT
from ferrodist.transport._start.accept import Refusals
from ferrodist.transport._start.auth import Secret, job_secret, where_to_listen
from ferrodist.transport._start.env import launch_info
from ferrodist.transport._start.join import dial, take
from ferrodist.transport._start.mesh import mesh
from ferrodist.transport._start.net import local_address
from ferrodist.transport._start.rendezvous import Rendezvous, open_store, open_store_through, report_bad_start
from ferrodist.transport._start.store import KeyValue, StoreClient, StoreServer

from .context import Context
from .framing import NOTICE_LIMIT
from .link import Link
from .records import DONE, Done, Pending, Recv

__all__ = ["TcpTransport"]

_BARRIER_TAGS = 0xFFFF << 48  # the transport's own barrier messages use tags from here
_DEFAULT_MAX_FRAME = 16 << 30
#: Seconds a notice may take to leave for one peer before that link is given up.
_NOTICE_SEND = 0.5


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

    kind = "tcp"

    def __init__(self, rank: int, world_size: int, *, timeout: float, max_frame_bytes: int) -> None:
        self._rank = rank
        self._world_size = world_size
        self._timeout = float(timeout)
        self._context = Context(rank, max_frame_bytes)  # what the links share
        self._links: dict[int, Link] = {}
        self._barriers = 0
        self._store: StoreClient | None = None
        self._server: StoreServer | None = None
        self._refusals = Refusals()  # connections from outside the job that this rank's ports refused
        self._leaving: FerrodistError | None = None  # why this rank leaves (its start failed), for its goodbyes
        self._key = b""  # the job's secret: a replacement of a lost rank must prove it too

    # -- rendezvous ---------------------------------------------------------------------------
    @classmethod
    def connect(
        cls,
        *,
        rank: int,
        world_size: int,
        master_addr: str | None = None,
        master_port: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        token: bytes | None = None,
        max_frame_bytes: int | None = None,
        rendezvous: KeyValue | None = None,
        one_host: bool | None = None,
        start_timeout: float | None = None,
    ) -> TcpTransport:
        """Join the job: rank 0 hosts the store on ``master_addr:master_port``, every rank
        registers there and publishes its own listening address, and the ranks connect
        pairwise (see ``rendezvous``). A bad start (two processes with one rank, ranks
        with different world sizes, the master port held by something else) fails on every
        rank within seconds, with the same error.

        ``timeout`` is how long a receive or a collective waits by default; ``start_timeout``
        (default: ``timeout``) how long this start may wait for the other ranks.

        ``rendezvous``: a key-value store the job already has (any object with blocking
        ``get(key) -> bytes`` and ``set(key, bytes)``, such as torch's ``c10d.Store``).
        Then rank 0 hosts the store on a port the OS picks and publishes where it is there
        (never a secret: without ``FERRODIST_TOKEN`` such a job is open, and rank 0 says so);
        ``master_port`` is not used, and ``master_addr``, when given, only picks the network
        interface (the one that routes to it; default: this host's name).

        The job's secret is ``token``, else ``FERRODIST_TOKEN``, else one the launcher
        shares (see ``auth.launcher_secret``: SLURM, mpiexec with mpi4py). Without any, the
        job listens on loopback only: ``one_host`` (default: the launcher's
        ``LOCAL_WORLD_SIZE == WORLD_SIZE``) says every rank runs on this host, and a job that
        may span hosts is refused.

        Example (each rank of a job that has a torch store)::

            t = TcpTransport.connect(rank=r, world_size=2, rendezvous=torch_store, master_addr="10.0.0.1")

        Raises:
            InvalidArgument: this rank's ``rank`` or ``world_size`` is wrong, or contradicts
                another rank's (the same error on every rank); or the job has no secret and
                may span hosts.
            BackendUnavailable: rank 0 cannot listen on the master port (say, it is in
                use), or what listens there is not this job's store.
            CollectiveTimeout: a rank did not show up within ``start_timeout``; names it (and the
                connections from outside the job that were refused meanwhile, if any).
            AuthenticationFailed: a peer (or the store) does not hold this job's secret.
        """
        deadline = time.monotonic() + (timeout if start_timeout is None else start_timeout)
        where = _describe_start(rank, master_addr, master_port, rendezvous)
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            bad = InvalidArgument(
                f"rank {rank}: TcpTransport.connect: need 0 <= rank < world_size, got rank={rank!r}, "
                f"world_size={world_size!r} (RANK and WORLD_SIZE): start every rank with the same WORLD_SIZE and "
                "a RANK below it"
            )
            if rendezvous is None and master_addr is not None and master_port is not None:
                _report_start_failure(bad, rank, world_size, master_addr, master_port, token, one_host)
            raise bad
        what = f"rank {rank}: joining a job of {world_size} ranks through {where}"
        secret = job_secret(token, rank, world_size, launcher=rendezvous is None, deadline=deadline)
        host = local_address(master_addr or socket.gethostname())
        if rendezvous is None:
            assert master_addr is not None and master_port is not None  # checked by _where
            master_addr, host = where_to_listen(
                secret, master_addr, host, one_host=one_host, rank=rank, world_size=world_size, what=what
            )
        limit = max_frame_bytes or int(os.environ.get("FERRODIST_MAX_FRAME_BYTES", _DEFAULT_MAX_FRAME))
        self = cls(rank, world_size, timeout=timeout, max_frame_bytes=limit)
        rdv: Rendezvous | None = None
        key = secret.key
        try:
            if rendezvous is not None:
                self._store, self._server, key = open_store_through(
                    rendezvous, rank, host, key, deadline, what, self._refusals
                )
            else:
                assert master_addr is not None and master_port is not None
                self._store, self._server = open_store(
                    rank, master_addr, master_port, key, deadline, what, self._refusals
                )
            rdv = Rendezvous(self._store, rank, world_size, deadline, what, self._refusals)
            rdv.join()
            self._key = key
            for peer, sock in mesh(rdv, host, key, self._refusals):
                self._add_link(peer, sock)
            rdv.finish(self._server, self._stop)
            stopped = self._context.lost.get(rank)
            if stopped is not None:  # an abort came while rank 0 marked the job started
                raise stopped
        except FerrodistError as exc:
            error = _with_start_notes(exc, rdv, secret)
            self._leaving = error
            if rdv is not None and rdv.aborted and self._server is not None:
                rdv.linger()  # the others read the reason from this store: keep it up until they have
            self.close()
            raise error from None
        except BaseException:
            self.close()
            raise
        for link in self._links.values():
            link.thread.start()
        return self

    @staticmethod
    def report_bad_start(
        error: FerrodistError,
        *,
        rank: object,
        world_size: object,
        master_addr: str,
        master_port: int,
        token: bytes | None = None,
        one_host: bool | None = None,
    ) -> None:
        """This process cannot join the job starting at ``master_addr:master_port`` (its
        ``rank`` or ``world_size`` is wrong, say): tell the ranks waiting for it why
        (``error``), so that they fail now with that reason instead of at their timeout.
        Best effort, a few seconds at most; the caller raises ``error`` afterwards.
        ``token`` and ``one_host`` as for ``connect``."""
        _report_start_failure(error, rank, world_size, master_addr, master_port, token, one_host)

    def _add_link(self, peer: int, sock: socket.socket) -> None:
        self._links[peer] = Link(peer, sock, self._context, self._links)

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

    def share_host(self, ranks: int) -> None:
        """This job runs ``ranks`` ranks on this host. Where they outnumber its cores, a rank
        that waits for a message it reads itself gives its core away (``sched_yield``) up to
        100 times before it sleeps in ``poll``: the rank it waits for is most likely one that
        waits for a core, and a sleep and a wake-up cost more than the message."""
        self.yields = yields_for(ranks)

    @property
    def yields(self) -> int:
        """How often a wait for a message gives the core away before it sleeps (see ``share_host``)."""
        return self._context.yields

    @yields.setter
    def yields(self, count: int) -> None:
        self._context.yields = count

    # -- receiving -----------------------------------------------------------------------------
    def irecv(self, buf: Buffer, src: int, tag: int = 0, *, fingerprint: int = 0) -> Recv:
        src = check_peer(self._rank, self._world_size, src, "recv")
        tag = check_tag(tag, "recv")
        pending = Pending(as_bytes(buf, "recv", writeable=True, rank=self._rank), tag, fingerprint, src)
        link = self._links[src]
        link.post(pending)
        return Recv(pending, link.wait, self._timeout)

    def irecv_any(self, buf: Buffer, sources: Sequence[int], tag: int = 0, *, fingerprint: int = 0) -> Recv:
        """Receive the first message with ``tag`` that any of ``sources`` sends (its
        ``source`` says whose)."""
        peers = check_sources(self._rank, self._world_size, sources)
        tag = check_tag(tag, "recv")
        pending = Pending(as_bytes(buf, "recv", writeable=True, rank=self._rank), tag, fingerprint, sources=peers)
        self._context.post_any(pending)
        return Recv(pending, self._context.wait, self._timeout)

    def recv(self, buf: Buffer, src: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0) -> None:
        self.irecv(buf, src, tag, fingerprint=fingerprint).wait(timeout)

    # -- sending -------------------------------------------------------------------------------
    def isend(self, buf: Buffer, dst: int, tag: int = 0, *, fingerprint: int = 0, timeout: float | None = None) -> Done:
        dst = check_peer(self._rank, self._world_size, dst, "send")
        tag = check_tag(tag, "send")
        limit = self._timeout if timeout is None else timeout
        self._links[dst].send_message(as_bytes(buf, "send"), tag, fingerprint, limit)
        return DONE

    def send(self, buf: Buffer, dst: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0) -> None:
        self.isend(buf, dst, tag, fingerprint=fingerprint, timeout=timeout)

    def sendrecv(
        self,
        send_buf: Buffer,
        dst: int,
        recv_buf: Buffer,
        src: int,
        tag: int = 0,
        *,
        timeout: float | None = None,
        fingerprint: int = 0,
    ) -> None:
        """Send ``send_buf`` to ``dst`` and receive ``recv_buf`` from ``src`` at once (one
        ring step): checked here, run by ``src``'s link (``Link.sendrecv``), whose caller
        reads ``src``'s frames itself for the whole call."""
        rank = self._rank
        src = check_peer(rank, self._world_size, src, "recv")
        dst = check_peer(rank, self._world_size, dst, "send")
        tag = check_tag(tag, "sendrecv")
        pending = Pending(as_bytes(recv_buf, "recv", writeable=True, rank=rank), tag, fingerprint, src)
        payload = as_bytes(send_buf, "send")
        links = self._links
        links[src].sendrecv(payload, links[dst], pending, self._timeout if timeout is None else timeout)

    def native_collectives(self, ranks: Sequence[int], channel: int) -> Any:
        """None: over TCP the collectives run their own algorithms (``ShmTransport`` has some)."""
        return None

    # -- a replacement for a lost rank ---------------------------------------------------------------
    @classmethod
    def join(
        cls,
        *,
        rank: int,
        world_size: int,
        announce: Callable[[str], None],
        members: Callable[[], Sequence[int] | None],
        timeout: float = DEFAULT_TIMEOUT,
        token: bytes | None = None,
        host: str = "127.0.0.1",
        start_timeout: float | None = None,
        others: Callable[[], Mapping[int, str]] | None = None,
    ) -> tuple[TcpTransport, tuple[int, ...]]:
        """Take the place of lost rank ``rank`` in a running job: listen on ``host`` and
        ``announce`` where (``host:port``); the live ranks of the group that takes this
        rank in dial it (``admit``), each proving the job's token, and so do the other
        replacements taken in with it of lower rank (``others()``: rank -> address, once the
        group is known; this one dials those of higher rank). Returns the transport and the
        group's members (global ranks) once ``members()`` (None until it is known) have all
        connected; the other ranks of the world count as gone."""
        start_timeout = timeout if start_timeout is None else start_timeout
        deadline = time.monotonic() + start_timeout
        what = f"rank {rank}: joining a running job of {world_size} ranks"
        secret = job_secret(token, rank, world_size, launcher=True, deadline=deadline)
        limit = int(os.environ.get("FERRODIST_MAX_FRAME_BYTES", _DEFAULT_MAX_FRAME))
        self = cls(rank, world_size, timeout=timeout, max_frame_bytes=limit)
        self._key = secret.key
        try:
            for peer, sock in take(host, secret.key, rank, world_size, announce, members, deadline, what, others):
                self._add_link(peer, sock)
        except BaseException:
            self.close()
            raise
        group = tuple(members() or ())
        for peer in range(world_size):
            if peer != rank and peer not in self._links:
                self._context.lose(peer, PeerLost(f"rank {peer} is not in the group rank {rank} joined", peer=peer))
        for link in self._links.values():
            link.thread.start()
        return self, group

    def admit(self, peer: int, address: str, *, timeout: float | None = None) -> None:
        """Connect to the replacement of lost rank ``peer`` at ``address`` (``host:port``)
        and take it as rank ``peer`` from now on (see ``join``)."""
        context = self._context
        if peer not in context.lost or peer == self._rank:
            raise InvalidArgument(
                f"rank {self._rank}: admit: rank {peer} is not a lost rank of this job; only a lost rank is replaced"
            )
        limit = self._timeout if timeout is None else timeout
        what = f"rank {self._rank}: taking in rank {peer}'s replacement"
        sock = dial(address, self._key, self._rank, self._world_size, peer, time.monotonic() + limit, what)
        old = self._links.get(peer)
        if old is not None:
            old.close(time.monotonic() + 1.0)
        with context.cond:
            context.lost.pop(peer, None)
            self._add_link(peer, sock)
        self._links[peer].thread.start()

    # -- aborting a channel ----------------------------------------------------------------------
    def abort(self, channel: int, error: FerrodistError, *, peers: Sequence[int], seq: int) -> None:
        """Abort ``channel`` here (see ``_aborts``) and send each of ``peers`` a notice, once
        per channel; a peer that does not take it within half a second is given up."""
        context = self._context
        earlier = context.aborts.first(other_than=channel)
        context.abort_here(channel, error)
        if not context.aborts.notify_once(channel):
            return
        senders = context.stopped.get(channel, set())
        if error.aborted_by is not None and error.awaited is None and len(senders) == 1:
            # Passing a peer's failure on: say whose message the receive it stopped waited for.
            error = copy.copy(error)
            error.awaited = next(iter(senders))
        notice = np.frombuffer(encode_notice(seq, error, self._rank, earlier, limit=NOTICE_LIMIT), np.uint8)
        for peer in peers:
            link = self._links.get(peer)
            if link is None or link.ended or peer in context.lost:
                continue
            try:
                link.send(ABORT, channel, 0, notice, _NOTICE_SEND)
            except TimeoutError:
                context.lose(
                    peer, PeerLost(f"rank {peer} stopped reading (an abort notice could not reach it)", peer=peer)
                )
            except OSError:
                pass  # its connection broke: its own reader reports that

    def aborted(self, channel: int) -> FerrodistError | None:
        """The error ``channel`` was aborted with (here or by a peer's notice), or None."""
        return self._context.aborts.error(channel)

    def on_abort(self, channel: int, respond: Callable[[FerrodistError, int], None]) -> None:
        """Call ``respond(error, seq)`` when a peer's notice first aborts ``channel`` here."""
        self._context.aborts.watch(channel, respond)

    def notices(self, channel: int) -> dict[int, Notice]:
        """The peers that sent a notice for ``channel``, each with the call it was in."""
        return self._context.aborts.heard(channel)

    def gone(self) -> frozenset[int]:
        """The peers whose connection ended."""
        return frozenset(peer for peer in list(self._context.lost) if peer != self._rank)

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

    def _stop(self, error: FerrodistError) -> None:
        """Stop this rank's part of the job with ``error`` (rank 0, when an abort comes just
        after the start, see ``rendezvous``): every later call here raises it, and every peer
        gets a goodbye that carries it. The connections stay up until ``close``."""
        context = self._context
        with context.cond:
            if context.closing or self._rank in context.lost:
                return
        context.lose(self._rank, error)
        why = np.frombuffer(encode_notice(-1, error, self._rank, limit=NOTICE_LIMIT), np.uint8)
        for link in list(self._links.values()):
            if link.peer not in context.lost and not link.farewell:
                try:
                    link.send(GOODBYE, 0, 0, why, _NOTICE_SEND)
                    link.farewell = True
                except (OSError, TimeoutError):
                    pass

    def close(self) -> None:
        """Say goodbye to every peer and close the connections (and the store on rank 0). Idempotent."""
        context = self._context
        if context.closing:
            return
        context.closing = True
        cause = (
            self._leaving
            or context.aborts.first()
            or context.lost.get(self._rank)
            or next((e for p, e in context.lost.items() if p != self._rank), None)
        )
        why = (
            None if cause is None else np.frombuffer(encode_notice(-1, cause, self._rank, limit=NOTICE_LIMIT), np.uint8)
        )
        for link in list(self._links.values()):
            try:
                if link.peer not in context.lost and not link.farewell:
                    link.send(GOODBYE, 0, 0, why, 1.0)  # with the failure that makes this rank leave
                link.sock.shutdown(socket.SHUT_RDWR)  # the goodbye still goes out; our reader wakes up
            except (OSError, TimeoutError):
                pass
        deadline = time.monotonic() + 2.0
        for link in self._links.values():
            link.close(deadline)
        context.lose(self._rank, PeerLost(f"rank {self._rank}: this transport is closed", peer=self._rank))
        if self._store is not None:
            self._store.close()
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _describe_start(rank: object, master_addr: str | None, master_port: int | None, rendezvous: KeyValue | None) -> str:
    """How the job starts, for messages; ``InvalidArgument`` when ``connect`` was told neither way."""
    if rendezvous is not None:
        if not isinstance(rendezvous, KeyValue):
            raise InvalidArgument(
                f"rank {rank}: TcpTransport.connect: rendezvous= needs get(key) and set(key, value) methods (a "
                f"key-value store such as torch.distributed.TCPStore), not a {type(rendezvous).__name__}"
            )
        return f"the key-value store {type(rendezvous).__name__}"
    if master_addr is None or master_port is None:
        raise InvalidArgument(
            f"rank {rank}: TcpTransport.connect: give master_addr= and master_port= (where rank 0 hosts the store), "
            "or rendezvous= (a key-value store every rank reaches)"
        )
    return f"{master_addr}:{master_port}"


def _report_start_failure(
    error: FerrodistError,
    rank: object,
    world_size: object,
    master_addr: str,
    master_port: int,
    token: bytes | None,
    one_host: bool | None,
) -> None:
    """``report_bad_start`` with the job's secret and master address as ``connect`` finds them
    (but no MPI broadcast: this process will not be in the one the others make)."""
    try:
        secret = job_secret(token, -1, -1, launcher=True, deadline=time.monotonic() + 1.0)
        if one_host is None:
            try:
                info = launch_info()
            except InvalidArgument:  # this process's own variables are what is wrong
                info = None
            one_host = info is not None and info.single_host
        master_addr, _ = where_to_listen(
            secret, master_addr, local_address(master_addr), one_host=one_host, rank=-1, world_size=-1, what=""
        )
    except FerrodistError:
        return  # nothing to report to: without a secret, the others refuse to start across hosts
    report_bad_start(rank, world_size, master_addr, master_port, secret.key, error)


def _with_start_notes(error: FerrodistError, rdv: Rendezvous | None, secret: Secret) -> FerrodistError:
    """A start's ``error``, with what it may have to do with: connections from outside the
    job that were refused meanwhile, and where this rank's secret came from."""
    note = rdv.outside() if rdv is not None and not rdv.aborted else ""
    if isinstance(error, AuthenticationFailed) and secret.source not in ("", "FERRODIST_TOKEN", "the token given"):
        note += f" (this rank's secret: {secret.source})"
    if not note:
        return error
    noted = copy.copy(error)
    noted.args = (error.message + note,)
    return noted
