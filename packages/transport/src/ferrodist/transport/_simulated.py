"""``SimulatedTransport``: n ranks as threads of one process, for tests and examples.

Messages are copied eagerly: a send never blocks, and a receive posted before its
message arrives gets the bytes copied straight into its buffer. Waits block on a
condition variable (never spin), so many ranks share few cores.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ferrodist.core import BackendUnavailable, CollectiveTimeout, FerrodistError, InvalidArgument, PeerLost

from ._aborts import Aborts, Notice, channel_of, decode_notice, encode_notice
from ._checks import (
    as_bytes,
    check_match,
    check_peer,
    check_sources,
    check_tag,
    lost_sender,
    receive_timeout,
    receiving,
)
from ._faults import Faults
from ._protocol import DEFAULT_TIMEOUT, Buffer
from ._start.memstore import MemoryStore

__all__ = ["SimulatedTransport"]

Key = tuple[int, int]  # (source rank, tag)


class _Mailbox:
    """Everything addressed to one rank: unmatched messages and posted receives (from one
    sender, or from any of several: ``anywhere``), numbered as they come (``order``) so that a
    message goes to the receive posted first and a receive takes the message that came first."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.unexpected: dict[Key, collections.deque[tuple[Buffer, int, int]]] = collections.defaultdict(
            collections.deque
        )
        self.posted: dict[Key, collections.deque[_Recv]] = collections.defaultdict(collections.deque)
        self.anywhere: dict[int, list[_Recv]] = {}  # tag -> receives from any of several senders
        self.order = 0

    def next(self) -> int:
        self.order += 1
        return self.order

    def taker(self, src: int, tag: int) -> _Recv | None:
        """The receive that takes ``src``'s next message with ``tag`` (now unqueued), if any."""
        queue = self.posted.get((src, tag))
        first = queue[0] if queue else None
        rivals = self.anywhere.get(tag)
        rival = next((r for r in rivals if src in r.sources), None) if rivals else None  # type: ignore[operator]
        if rival is not None and (first is None or rival.order < first.order):
            rivals.remove(rival)  # type: ignore[union-attr]
            if not rivals:
                del self.anywhere[tag]
            rival.src = src
            return rival
        if first is not None:
            queue.popleft()  # type: ignore[union-attr]
        return first

    def earliest(self, sources: tuple[int, ...], tag: int) -> Key | None:
        """Of the messages kept from ``sources`` with ``tag``, the key of the one that came first."""
        kept = [(self.unexpected[(src, tag)][0][2], src) for src in sources if self.unexpected.get((src, tag))]
        return (min(kept)[1], tag) if kept else None


class _Hub:
    """State shared by the n simulated ranks of one world."""

    def __init__(self, world_size: int, faults: Faults) -> None:
        self.world_size = world_size
        self.faults = faults
        self.sent = [0] * world_size  # messages each rank has tried to send
        self.mailboxes = [_Mailbox() for _ in range(world_size)]
        self.closed = [False] * world_size
        self.died: set[int] = set()  # ranks closed by an injected death (Faults.die_at)
        self.aborts = [Aborts() for _ in range(world_size)]
        self.barrier_cond = threading.Condition(threading.Lock())
        self.barrier_generation = 0
        self.barrier_arrived: set[int] = set()
        self.store = MemoryStore()

    def drop(self, rank: int, channel: int) -> None:
        """Forget the messages of an aborted channel that wait for ``rank``'s receives."""
        box = self.mailboxes[rank]
        with box.cond:
            for key in [key for key in box.unexpected if channel_of(key[1]) == channel]:
                del box.unexpected[key]

    def departure(self, peer: int, rank: int) -> PeerLost:
        """The error ``rank`` gets for waiting on ``peer``, which closed (or died)."""
        if peer in self.died:
            return PeerLost(f"rank {peer} failed (Faults.die_at); see that rank's error", peer=peer, rank=rank)
        return PeerLost(f"rank {peer} closed its transport", peer=peer, rank=rank, finished=True)

    def wake_all(self) -> None:
        for box in self.mailboxes:
            with box.cond:
                box.cond.notify_all()
        with self.barrier_cond:
            self.barrier_cond.notify_all()


class _Done:
    """A request that completed when it was created (simulated sends are eager)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _Recv:
    """A posted receive: filled by the sender's thread, or at once from an unmatched message."""

    def __init__(
        self,
        transport: SimulatedTransport,
        buf: Buffer,
        src: int,
        tag: int,
        fingerprint: int,
        sources: tuple[int, ...] | None = None,
    ) -> None:
        self.transport = transport
        self.buf = buf
        self.src = src  # -1 for a receive from any of ``sources`` until a message is matched with it
        self.sources = sources
        self.tag = tag
        self.fingerprint = fingerprint
        self.order = 0
        self.done = False
        self.error: BaseException | None = None

    @property
    def source(self) -> int | None:
        """The rank the message came from; None before one was matched with this receive."""
        return None if self.src < 0 else self.src

    def fill(self, payload: Buffer, fingerprint: int) -> None:
        """Copy a message in (or record why not); the caller holds the mailbox lock."""
        self.error = check_match(
            self.transport.rank, self.src, self.tag, self.buf.nbytes, self.fingerprint, payload.nbytes, fingerprint
        )
        if self.error is None:
            self.buf[...] = payload
        self.done = True

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        t = self.transport
        limit = t.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        box = t._hub.mailboxes[t.rank]
        aborts, channel = t._hub.aborts[t.rank], channel_of(self.tag)
        senders = (self.src,) if self.sources is None else self.sources
        with box.cond:
            while not self.done:
                aborted = aborts.error(channel)
                if aborted is not None:
                    self._withdraw(box)
                    failed = aborted.with_context(f"rank {t.rank}: {receiving(self)}")
                    failed.awaited = self.src if self.sources is None else None
                    raise failed
                gone = {peer: t._hub.departure(peer, t.rank) for peer in senders if t._hub.closed[peer]}
                failure = lost_sender(gone, senders) if gone else None
                if failure is not None:
                    self._withdraw(box)
                    raise failure.with_context(f"rank {t.rank} was waiting for {receiving(self, 'a message')}")
                if t._hub.closed[t.rank]:
                    self._withdraw(box)
                    raise PeerLost(
                        f"rank {t.rank}: this transport was closed while receiving", peer=t.rank, rank=t.rank
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._withdraw(box)
                    raise receive_timeout(t.rank, senders, self.tag, limit)
                box.cond.wait(remaining)
        if self.error is not None:
            raise self.error

    def _withdraw(self, box: _Mailbox) -> None:
        """Stop waiting: a late message must not land in a buffer the caller has given up on."""
        if self.sources is not None:
            rivals = box.anywhere.get(self.tag, [])
            if self in rivals:
                rivals.remove(self)
            return
        queue = box.posted.get((self.src, self.tag))
        if queue is not None and self in queue:
            queue.remove(self)


class SimulatedTransport:
    """One rank of an in-process world; build a world with :meth:`create_group`.

    Example:
        >>> t0, t1 = SimulatedTransport.create_group(2)
        >>> t0.send(np.arange(3, dtype=np.int32), dst=1, tag=7)
        >>> out = np.empty(3, np.int32); t1.recv(out, src=0, tag=7); out
        array([0, 1, 2], dtype=int32)
    """

    kind = "simulated"

    def __init__(self, hub: _Hub, rank: int, timeout: float) -> None:
        self._hub = hub
        self._rank = rank
        self._timeout = float(timeout)

    @classmethod
    def create_group(
        cls, world_size: int, *, timeout: float = DEFAULT_TIMEOUT, faults: Faults | None = None
    ) -> list[SimulatedTransport]:
        """``world_size`` connected transports, one per rank (rank i at index i), with
        ``faults`` injected (see :class:`Faults`)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgument(
                f"SimulatedTransport.create_group: world_size must be an int >= 1, not {world_size!r}"
            )
        if timeout <= 0:
            raise InvalidArgument(f"SimulatedTransport.create_group: timeout must be positive, not {timeout!r}")
        faults = faults or Faults()
        faults.check(world_size)
        hub = _Hub(world_size, faults)
        return [cls(hub, r, timeout) for r in range(world_size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._hub.world_size

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def store(self) -> MemoryStore:
        """The world's in-process key-value store (shared by its ranks)."""
        return self._hub.store

    @property
    def closed(self) -> bool:
        return self._hub.closed[self._rank]

    def __repr__(self) -> str:
        return f"SimulatedTransport(rank={self._rank}, world_size={self.world_size})"

    def _peer(self, peer: int, what: str) -> int:
        peer = check_peer(self._rank, self.world_size, peer, what)
        if self.closed:
            raise PeerLost(f"rank {self._rank}: {what} on a closed transport", peer=self._rank, rank=self._rank)
        return peer

    # -- point to point -----------------------------------------------------------------------
    def isend(self, buf: Buffer, dst: int, tag: int = 0, *, fingerprint: int = 0) -> _Done:
        dst = self._peer(dst, "send")
        tag = check_tag(tag, "send")
        payload = as_bytes(buf, "send")
        aborted = self._hub.aborts[self._rank].error(channel_of(tag))
        if aborted is not None:
            raise aborted.with_context(f"rank {self._rank}: send to rank {dst}")
        if not self._inject_faults(dst):
            return _Done()  # a silent rank: the message is lost
        if self._hub.closed[dst]:
            raise PeerLost(
                f"rank {self._rank} cannot send to rank {dst}: rank {dst} closed or failed", peer=dst, rank=self._rank
            )
        if self._hub.aborts[dst].error(channel_of(tag)) is not None:
            return _Done()  # the receiver has given the channel up: nobody will take it
        box = self._hub.mailboxes[dst]
        key = (self._rank, tag)
        with box.cond:
            waiting = box.taker(self._rank, tag)
            if waiting is not None:
                waiting.fill(payload, fingerprint)
                box.cond.notify_all()
            else:
                box.unexpected[key].append((payload.copy(), fingerprint, box.next()))
        return _Done()

    def _inject_faults(self, dst: int) -> bool:
        """Apply this rank's injected faults to its next message; False if the message is lost."""
        hub, me = self._hub, self._rank
        hub.sent[me] += 1
        count = hub.sent[me]
        if me in hub.faults.delay:
            time.sleep(hub.faults.delay[me])
        if hub.faults.die_at.get(me) == count:
            hub.died.add(me)
            self.close()
            raise PeerLost(
                f"rank {me}: injected fault: this rank died at its message {count} (Faults.die_at)", peer=me, rank=me
            )
        return count < hub.faults.silent_at.get(me, count + 1)

    def send(self, buf: Buffer, dst: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0) -> None:
        self.isend(buf, dst, tag, fingerprint=fingerprint).wait(timeout)

    def irecv(self, buf: Buffer, src: int, tag: int = 0, *, fingerprint: int = 0) -> _Recv:
        src = self._peer(src, "recv")
        tag = check_tag(tag, "recv")
        target = as_bytes(buf, "recv", writeable=True, rank=self._rank)
        return self._post(_Recv(self, target, src, tag, fingerprint))

    def irecv_any(self, buf: Buffer, sources: Sequence[int], tag: int = 0, *, fingerprint: int = 0) -> _Recv:
        """Receive the first message with ``tag`` that any of ``sources`` sends (its
        ``source`` says whose)."""
        peers = tuple(self._peer(peer, "recv") for peer in check_sources(self._rank, self.world_size, sources))
        tag = check_tag(tag, "recv")
        target = as_bytes(buf, "recv", writeable=True, rank=self._rank)
        return self._post(_Recv(self, target, -1, tag, fingerprint, peers))

    def _post(self, request: _Recv) -> _Recv:
        """Match ``request`` with the message kept for it that came first, else queue it."""
        box = self._hub.mailboxes[self._rank]
        with box.cond:
            key = (request.src, request.tag) if request.sources is None else box.earliest(request.sources, request.tag)
            kept = box.unexpected.get(key) if key is not None else None
            if kept:
                request.src = key[0]  # type: ignore[index]
                payload, fingerprint, _ = kept.popleft()
                request.fill(payload, fingerprint)
                if not kept:
                    del box.unexpected[key]  # type: ignore[arg-type]
            elif request.sources is None:
                request.order = box.next()
                box.posted[(request.src, request.tag)].append(request)
            else:
                request.order = box.next()
                box.anywhere.setdefault(request.tag, []).append(request)
        return request

    def recv(self, buf: Buffer, src: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0) -> None:
        self.irecv(buf, src, tag, fingerprint=fingerprint).wait(timeout)

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
        """Send to ``dst`` and receive from ``src`` at once (one ring step)."""
        incoming = self.irecv(recv_buf, src, tag, fingerprint=fingerprint)
        self.isend(send_buf, dst, tag, fingerprint=fingerprint)
        incoming.wait(timeout)

    def admit(self, peer: int, address: str, *, timeout: float | None = None) -> None:
        """Never: the ranks of a simulated world are the threads it was made with."""
        raise BackendUnavailable(f"rank {self._rank}: a simulated world cannot take in a new process (rank {peer})")

    def native_collectives(self, ranks: Sequence[int], channel: int) -> None:
        """None: simulated ranks run the collectives' own algorithms."""
        return None

    # -- aborting a channel ----------------------------------------------------------------------
    def abort(self, channel: int, error: FerrodistError, *, peers: Sequence[int], seq: int) -> None:
        """Abort ``channel`` here and on ``peers`` (see ``ferrodist.transport._aborts``)."""
        hub, me = self._hub, self._rank
        earlier = hub.aborts[me].first(other_than=channel)
        hub.aborts[me].record(channel, error)
        hub.drop(me, channel)
        if hub.aborts[me].notify_once(channel):
            notice = encode_notice(seq, error, me, earlier)
            for peer in peers:
                if peer != me and not hub.closed[peer]:
                    got_seq, copy = decode_notice(notice, peer, me)  # what a real wire would deliver
                    hub.aborts[peer].hear(channel, me, got_seq, copy)
                    hub.drop(peer, channel)
        hub.wake_all()

    def aborted(self, channel: int) -> FerrodistError | None:
        """The error ``channel`` was aborted with (here or by a peer's notice), or None."""
        return self._hub.aborts[self._rank].error(channel)

    def on_abort(self, channel: int, respond: Callable[[FerrodistError, int], None]) -> None:
        """Call ``respond(error, seq)`` when a peer's notice first aborts ``channel`` here."""
        self._hub.aborts[self._rank].watch(channel, respond)

    def notices(self, channel: int) -> dict[int, Notice]:
        """The peers that sent a notice for ``channel``, each with the call it was in."""
        return self._hub.aborts[self._rank].heard(channel)

    def gone(self) -> frozenset[int]:
        """The peers that closed their transport (or died by an injected fault)."""
        closed = self._hub.closed
        return frozenset(peer for peer in range(len(closed)) if closed[peer] and peer != self._rank)

    def share_host(self, ranks: int) -> None:
        """Nothing: the ranks are threads of one process, whose waits are condition variables."""

    # -- whole world ---------------------------------------------------------------------------
    def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank of the world has called ``barrier``."""
        hub = self._hub
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with hub.barrier_cond:
            generation = hub.barrier_generation
            hub.barrier_arrived.add(self._rank)
            if len(hub.barrier_arrived) == hub.world_size:
                hub.barrier_arrived.clear()
                hub.barrier_generation += 1
                hub.barrier_cond.notify_all()
                return
            while hub.barrier_generation == generation:
                missing = sorted(set(range(hub.world_size)) - hub.barrier_arrived)
                lost = [r for r in missing if hub.closed[r]]
                remaining = deadline - time.monotonic()
                if lost or remaining <= 0:
                    hub.barrier_arrived.discard(self._rank)
                    if lost:
                        raise PeerLost(
                            f"rank {self._rank}: barrier cannot complete, rank {lost[0]} closed or failed",
                            peer=lost[0],
                            rank=self._rank,
                        )
                    raise CollectiveTimeout(
                        f"rank {self._rank}: barrier timed out after {limit:g} s; ranks {missing} never arrived",
                        rank=self._rank,
                        operation="barrier",
                        waiting_for=tuple(missing),
                    )
                hub.barrier_cond.wait(remaining)

    def close(self) -> None:
        """Leave the world: peers waiting on this rank get ``PeerLost`` at once. Idempotent."""
        if not self._hub.closed[self._rank]:
            self._hub.closed[self._rank] = True
            self._hub.wake_all()

    def __enter__(self) -> SimulatedTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
