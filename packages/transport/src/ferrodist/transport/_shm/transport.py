"""``ShmTransport``: a single-host job whose collectives move through shared memory.

Point to point, rendezvous and failure detection are those of ``TcpTransport`` (so a
rank that dies is noticed at once); whole-world collectives go through the job's
``Arena`` (``ShmCollectives``), which rank 0 makes and every rank maps at the start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from ferrodist.core import BackendUnavailable, CollectiveTimeout, FerrodistError, InvalidArgument, PeerLost
from ferrodist.core.kernels import Ticket
from ferrodist.transport._protocol import DEFAULT_TIMEOUT
from ferrodist.transport._start.env import this_host
from ferrodist.transport._start.rendezvous import Rendezvous
from ferrodist.transport._start.store import KeyValue
from ferrodist.transport._tcp.transport import TcpTransport

from . import spin
from .arena import DEFAULT_SLOTS, Arena, default_chunk
from .collectives import ShmCollectives
from .segment import SegmentGone, create_segment, open_segment

__all__ = ["ShmTransport"]


class ShmTransport(TcpTransport):
    """``TcpTransport`` plus a shared-memory arena for whole-world collectives.

    All ranks must be on one host; ``connect`` raises ``BackendUnavailable`` otherwise.
    Sizing: ``FERRODIST_SHM_CHUNK`` bytes per slot (default: half a core's L2 cache, 256 KiB
    to 1 MiB, see ``default_chunk``), ``FERRODIST_SHM_SLOTS`` slots per rank (default 2, at
    most 6).
    """

    kind = "shm"

    def __init__(self, rank: int, world_size: int, *, timeout: float, max_frame_bytes: int) -> None:
        super().__init__(rank, world_size, timeout=timeout, max_frame_bytes=max_frame_bytes)
        self._arena: Arena | None = None
        self._arena_taken = False

    @classmethod
    def connect(  # type: ignore[override]
        cls,
        *,
        rank: int,
        world_size: int,
        master_addr: str | None = None,
        master_port: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        token: bytes | None = None,
        max_frame_bytes: int | None = None,
        chunk: int | None = None,
        slots: int | None = None,
        rendezvous: KeyValue | None = None,
        start_timeout: float | None = None,
    ) -> ShmTransport:
        """``TcpTransport.connect`` (``rendezvous=`` included; every rank is on this host, so
        a job without a secret listens on loopback), then the shared-memory arena: rank 0
        creates it, every rank maps it. A rank that cannot (or whose slot sizes differ from
        rank 0's) makes every rank fail at once with its reason."""
        chunk = chunk or int(os.environ.get("FERRODIST_SHM_CHUNK", 0)) or default_chunk()
        slots = slots or int(os.environ.get("FERRODIST_SHM_SLOTS", DEFAULT_SLOTS))
        if chunk < 64 or chunk % 64 or not 1 <= slots <= 6:
            bad = InvalidArgument(
                f"rank {rank}: shared memory: chunk must be a positive multiple of 64 bytes and slots 1..6, got "
                f"{chunk}, {slots} (FERRODIST_SHM_CHUNK, FERRODIST_SHM_SLOTS)"
            )
            if rendezvous is None and master_addr is not None and master_port is not None:
                TcpTransport.report_bad_start(
                    bad,
                    rank=rank,
                    world_size=world_size,
                    master_addr=master_addr,
                    master_port=master_port,
                    token=token,
                    one_host=True,
                )
            raise bad
        waits = spin.prepare_waits()  # compiled in the background while the ranks meet
        start_timeout = timeout if start_timeout is None else start_timeout
        deadline = time.monotonic() + start_timeout
        self = super().connect(
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            timeout=timeout,
            token=token,
            max_frame_bytes=max_frame_bytes,
            rendezvous=rendezvous,
            one_host=True,
            start_timeout=start_timeout,
        )
        assert isinstance(self, ShmTransport)
        what = f"rank {rank}: opening the shared memory of a job of {world_size} ranks"
        rdv = Rendezvous(self.store, rank, world_size, deadline, what)
        try:
            _ready(waits, rank, deadline)  # before the arena: rank 0 returns once every rank is ready
            self._arena = self._open_arena(rdv, chunk, slots)
        except BaseException:
            if rdv.aborted and rank == 0:
                rdv.linger()
            self.close()
            raise
        self.share_host(world_size)
        return self

    def _open_arena(self, rdv: Rendezvous, chunk: int, slots: int) -> Arena:
        """Rank 0 makes the arena's segment (see ``segment``) and holds it until every rank
        has mapped it; the others open it by the address rank 0 publishes in the store.

        Nothing is left behind whatever rank is killed, and when: the segment has no name
        (or, without memfd, loses it once mapped everywhere). A rank 0 that dies before a
        rank has mapped the arena makes that rank raise ``PeerLost`` naming rank 0; a rank
        that cannot map it, or whose slot sizes differ from rank 0's, aborts the start of
        every rank with its reason (``rdv``).
        """
        store, rank, world = self.store, self.rank, self.world_size
        size = Arena.size(world, chunk, slots)
        if rank == 0:
            self._check_one_host(rdv)
            try:
                segment = create_segment(size)
            except OSError as exc:
                rdv.abort(BackendUnavailable(f"rank 0 could not create the shared memory ({exc})"))
            try:
                arena = Arena.create(segment.fd, rank, world, chunk, slots)
                try:
                    store.set("ferrodist/shm/segment", f"{chunk} {slots} {segment.address}", timeout=rdv.left())
                    self._wait_attached(rdv)
                except BaseException:
                    arena.close()
                    raise
            finally:
                segment.release()  # every rank has it mapped (or the job failed): no name, no descriptor left
            return arena
        what = f"rank {rank}: waiting for rank 0's shared-memory arena"
        try:
            self._check_one_host(rdv)
            their_chunk, their_slots, address = (
                rdv.get("ferrodist/shm/segment", 0, "created the shared memory").decode().split(" ", 2)
            )
        except PeerLost as exc:
            if exc.peer != 0:
                raise
            raise exc.with_context(f"{what} (rank 0 is gone; see its output for why)", rank=rank) from None
        if (int(their_chunk), int(their_slots)) != (chunk, slots):
            rdv.abort(
                InvalidArgument(
                    f"rank {rank} has FERRODIST_SHM_CHUNK={chunk}, FERRODIST_SHM_SLOTS={slots} but rank 0 has "
                    f"{their_chunk}, {their_slots}: give every rank the same values"
                )
            )
        try:
            fd = open_segment(address, size)
        except SegmentGone as exc:
            raise self._creator_lost(what, str(exc), rdv.deadline) from None
        except (OSError, ValueError) as exc:
            rdv.abort(BackendUnavailable(f"rank {rank} could not map the shared memory ({exc})"))
        try:
            arena = Arena.attach(fd, rank, world, chunk, slots)
        finally:
            os.close(fd)
        store.set(f"ferrodist/shm/attached/{rank}", b"", timeout=rdv.left())
        return arena

    def _check_one_host(self, rdv: Rendezvous) -> None:
        """Publish this rank's host and raise ``BackendUnavailable`` unless every rank says
        the same one."""
        rank, world = self.rank, self.world_size
        self.store.set(f"ferrodist/shm/host/{rank}", this_host(), timeout=rdv.left())
        hosts = {rdv.get(f"ferrodist/shm/host/{r}", r, "said which host it is on").decode() for r in range(world)}
        if len(hosts) > 1:
            raise BackendUnavailable(
                f"rank {rank}: the shm backend needs every rank on one host, but they are on {len(hosts)}; "
                "use backend='tcp' (or 'auto')"
            )

    def _wait_attached(self, rdv: Rendezvous) -> None:
        """Rank 0: return once every other rank has mapped the arena; raise as soon as one
        is lost or the start is aborted, or at the deadline naming the ranks that did not."""
        store, world = self.store, self.world_size
        keys = [f"ferrodist/shm/attached/{r}" for r in range(1, world)]
        while keys:
            try:
                store.wait(keys, timeout=min(rdv.left(), 0.1))
                return
            except CollectiveTimeout:
                pass
            for error in list(self._context.lost.values()):
                rdv.check()  # a rank that left because the start was aborted: raise the reason
                raise error.with_context("rank 0: a rank was lost before it mapped the shared-memory arena")
            rdv.check_due()
            if rdv.expired():
                late = [r for r in range(1, world) if not store.check([f"ferrodist/shm/attached/{r}"])]
                raise CollectiveTimeout(
                    f"rank 0: ranks {late} did not map the shared-memory arena within the timeout",
                    rank=0,
                    waiting_for=tuple(late),
                )

    def _creator_lost(self, what: str, why: str, deadline: float) -> FerrodistError:
        """The error for a segment rank 0 no longer holds: ``PeerLost`` if rank 0 is gone
        (its store stops answering within a second), else ``BackendUnavailable``."""
        give_up = min(deadline, time.monotonic() + 1.0)
        try:
            while time.monotonic() < give_up:
                self.store.check(["ferrodist/shm/segment"])
                time.sleep(0.02)
        except PeerLost:
            return PeerLost(
                f"{what}: rank 0 died before this rank could map the arena ({why}); see rank 0's output for why",
                peer=0,
                rank=self.rank,
            )
        return BackendUnavailable(
            f"{what}: rank 0 runs but its arena cannot be opened ({why}): rank 0 gave up waiting, or the ranks "
            "run in different PID namespaces (containers); set FERRODIST_SHM_MEMFD=0 or use backend='tcp'",
            rank=self.rank,
        )

    def native_collectives(self, ranks: Sequence[int], channel: int) -> ShmCollectives | None:
        """The arena's collectives, for the first group over the whole world that asks (the
        world group): one group's calls are ordered, and no two groups share the arena's
        slots. Other groups use the TCP algorithms. The collectives stop with the channel's
        abort and with a lost peer."""
        if self._arena is None or self._arena_taken or list(ranks) != list(range(self.world_size)):
            return None
        self._arena_taken = True
        lost, aborts = self._context.lost, self._context.aborts

        def health() -> None:
            error = aborts.error(channel)
            if error is not None:
                raise error.with_context(f"rank {self.rank}: during a shared-memory collective")
            for error in list(lost.values()) if lost else ():
                raise error.with_context(f"rank {self.rank}: a peer was lost during a shared-memory collective")

        return ShmCollectives(self._arena, health, self.rank)

    def share_host(self, ranks: int) -> None:
        """This job runs ``ranks`` ranks on this host in all, this transport's or more (nodes of
        one job that share a host): its waits, in shared memory and on sockets, give the
        core away where those ranks outnumber the cores."""
        super().share_host(max(ranks, self.world_size))
        if self._arena is not None:
            self._arena.share_host(max(ranks, self.world_size))

    def close(self) -> None:
        super().close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None


def _ready(waits: Ticket, rank: int, deadline: float) -> None:
    """Wait, within init's deadline, for the compiled waits of the arena."""
    if waits.wait(_left(deadline)):
        return
    if waits.failed is not None:
        raise BackendUnavailable(
            f"rank {rank}: the shared-memory waits did not compile ({waits.failed}); use backend='tcp'"
        )
    raise CollectiveTimeout(
        f"rank {rank}: the shared-memory waits were still compiling at the start's deadline (raise init_timeout, "
        "or run `ferrodist warm` once)",
        rank=rank,
    )


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
