"""``ShmTransport``: a single-host job whose collectives move through shared memory.

Point to point, rendezvous and failure detection are those of ``TcpTransport`` (so a
rank that dies is noticed at once); whole-world collectives go through the job's
``Arena``: data is cut into chunks, each chunk passes through small slots that are
reused, so it stays in cache between the rank that writes it and the ranks that read it,
and the reductions read all ranks' slots in one fused pass.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ferrodist.core import (
    BackendUnavailable,
    CollectiveTimeout,
    DType,
    FerrodistError,
    InvalidArgument,
    PeerLost,
    ReduceOp,
    reducer,
)
from ferrodist.core.kernels import NotCompiled, Ticket, pairwise_opcode, plan, prepare
from ferrodist.transport._protocol import DEFAULT_TIMEOUT
from ferrodist.transport._slots import DEFAULT_SLOTS, default_chunk
from ferrodist.transport._start.env import this_host
from ferrodist.transport._start.rendezvous import Rendezvous
from ferrodist.transport._start.store import KeyValue
from ferrodist.transport._tcp.transport import TcpTransport

from . import loops, spin, stepwise
from .arena import Arena
from .fronts import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER, SMALL, SMALL_START
from .segment import SegmentGone, create_segment, open_segment

__all__ = ["ShmCollectives", "ShmTransport"]

Array = np.ndarray[Any, Any]

#: all_reduce moves at most this many bytes (size x ranks) the one-sync way, in which every
#: rank reduces everything; above it the pipeline (each rank reduces 1/p) is faster here.
SMALL_ALL_REDUCE = 32 << 10


class ShmCollectives:
    """The world's collectives through the arena (same interface as ``MpiCollectives``).

    No call waits for a compiler: a collective whose compiled loop is not ready for its
    dtype (a first call, on a cold or a warm Numba cache) runs the same protocol step by
    step in Python (``stepwise``) while the loop compiles in the background, so ranks on
    either path meet in the same call and get the same bits.
    """

    def __init__(self, arena: Arena, health: Callable[[], None], global_rank: int) -> None:
        self._a = arena
        self._health = health
        self._rank = global_rank
        self._plans: dict[tuple[str, int, int], tuple[list[list[Array]], Any, float]] = {}
        self._folds: dict[tuple[DType, ReduceOp], Any] = {}
        self._state = loops.new_state()
        # (dtype, op) -> what ``_small_kind`` says for the one-slot all_reduce
        self._small_kinds: dict[tuple[DType, ReduceOp], tuple[Any, ...]] = {}
        self._state[loops.ME], self._state[loops.RANKS] = arena.rank, arena.world
        self._state[loops.SLOTS], self._state[loops.BYTES] = arena.slots, arena.chunk
        self._state[loops.SPINS] = arena.spins
        self.all_reduce_up_to = 1 << 62  # the arena is the fastest way at every size

    @property
    def size(self) -> int:
        return self._a.world

    def supports(self, dt: DType, op: ReduceOp | None = None) -> bool:
        return True

    def free(self) -> None:
        """Nothing to free: the arena belongs to the transport."""

    # -- plumbing --------------------------------------------------------------------------------
    def _sync(self, deadline: float, fingerprint: int, seq: int) -> None:
        """A chunk without data: every rank shows up and every rank checks every call."""
        stepwise.sync(self._a, self._health, deadline, fingerprint, seq)

    def _small_plan(self, dt: DType, op: ReduceOp, count: int) -> tuple[list[list[Array]], Any, float]:
        """Slot views (per slot, per rank), kernel and divisor of a one-chunk all_reduce,
        made once per (dtype, op, count): the small-message path does no other set-up."""
        key = (dt.name, op.value, count)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 256:
                self._plans.clear()
            a = self._a
            views = [[a.slot(q, s, dt.numpy, count) for q in range(a.world)] for s in range(a.slots)]
            plan = self._plans[key] = (views, self._fold(dt, op), op.divisor(a.world))
        return plan

    def _fold(self, dt: DType, op: ReduceOp) -> Any:
        fold = self._folds.get((dt, op))
        if fold is None:
            fold = self._folds[(dt, op)] = stepwise.fold_for(dt, op, self._a.world)
        return fold

    def _per(self, dt: DType, parts: int = 1) -> int:
        per = self._a.chunk // (dt.itemsize * parts)
        if per < 1:
            raise InvalidArgument(f"shared-memory chunk of {self._a.chunk} bytes is too small for {dt.name}")
        return per

    # -- collectives -------------------------------------------------------------------------------
    def all_reduce(
        self, x: Array, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        """Small messages (size x ranks up to ``SMALL_ALL_REDUCE``): every rank publishes its
        data and reduces all of it (one sync). Larger: per chunk, reduce-scatter through the
        slots, then gather (bandwidth-optimal)."""
        a, p = self._a, self._a.world
        if 0 < x.nbytes and x.nbytes * p <= min(2 * a.chunk, SMALL_ALL_REDUCE):
            small = self._small_kinds.get((dt, op))
            if small is None:
                small = self._small_kinds[(dt, op)] = self._small_kind(dt, op)
            if small:
                view, opcode, divisor, half = small
                flat, data, words, state = (x if view is None else x.view(view)), a.data, a.words, self._state
                call_id = fingerprint - (1 << 64) if fingerprint >= 1 << 63 else fingerprint  # its 64 bits
                state[loops.SPINS] = a.small_spins
                try:
                    status = SMALL_START(flat, data, words, state, divisor, a.chunks, opcode, half, call_id, seq + 1)
                except NotCompiled as missing:
                    # The resumption first: a front that runs the start finds it ready.
                    prepare([(SMALL, missing.types[:5]), (missing.front, missing.types)])
                else:
                    if status == loops.DONE:  # the common case: no Python wait, no wake-up
                        a.chunks = int(state[loops.CHUNK])
                        return
                    step = lambda state: SMALL(flat, data, words, state, divisor)  # noqa: E731
                    self._resume(step, status, deadline, fingerprint, seq, bulk=False)
                    return
            # One rank, or the compiled loop not ready: the same protocol in Python.
            views, fold, divisor = self._small_plan(dt, op, x.shape[0])
            stepwise.all_reduce_slot(a, self._health, x, views, fold, divisor, deadline, fingerprint, seq)
            return
        self._reduce_chunks(x, dt, op, deadline, fingerprint, seq, root=None)

    def reduce(
        self, x: Array, root: int, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        self._reduce_chunks(x, dt, op, deadline, fingerprint, seq, root=root)

    def _reduce_chunks(
        self, x: Array, dt: DType, op: ReduceOp, deadline: float, fingerprint: int, seq: int, root: int | None
    ) -> None:
        """Direct reduce-scatter + gather, chunk by chunk (``loops.all_reduce``). Each chunk
        is cut into one block per rank. A rank copies into its slot only the blocks other
        ranks reduce; it reduces its own block from ``x`` and the peers' slots into its slot
        (one fused pass, never in place, so the loop vectorises), copies the result back
        into ``x``, and every rank (``root=None``) or the root alone copies the other blocks
        from their owners' slots. ``x`` is read once and written once, and its lines are
        still in cache when they are written. float16/bfloat16 fold in float32 blocks."""
        a, p = self._a, self._a.world
        divisor = op.divisor(p)
        self._per(dt)  # the chunk must hold an element
        if p > 1 and x.shape[0] == 0:
            self._sync(deadline, fingerprint, seq)
            return
        if p > 1:
            view, opcode, _, half = self._small_kind(dt, op)
            flat, data, words = (x if view is None else x.view(view)), a.data, a.words
            bulk = x.nbytes > a.chunk
            state = self._start(fingerprint, seq, opcode, -1 if root is None else root, bulk)
            state[loops.HALF] = half
            step = lambda state: ALL_REDUCE(flat, data, words, state, divisor)  # noqa: E731
            try:
                status = step(state)
            except NotCompiled as missing:
                prepare([(missing.front, missing.types)])
                fold = self._fold(dt, op)
                stepwise.all_reduce(a, self._health, x, fold, divisor, root, deadline, fingerprint, seq)
                return
            self._resume(step, status, deadline, fingerprint, seq, bulk)
            return
        reducer(dt, op)(x, [x], divisor)  # one rank: its own data, as the kernels round it

    def _small_kind(self, dt: DType, op: ReduceOp) -> tuple[Any, ...]:
        """(view, opcode, divisor, half) for ``loops.all_reduce_small`` and
        ``loops.all_reduce``, or () (one rank)."""
        p = self._a.world
        if p < 2:
            return ()
        divisor = op.divisor(p)
        kind, view, opcode = plan(dt, op)  # kind: 0, or the 16-bit float type (BF16, F16)
        return (view, opcode, divisor, kind)

    def _start(self, fingerprint: int, seq: int, op: int = 0, root: int = -1, bulk: bool = True) -> Array:
        """The state words for a compiled loop of ``loops`` starting now (``bulk``: over
        more than one chunk, see ``SpinPolicy.spins``)."""
        state = self._state
        state[: loops.ME] = 0
        state[loops.HALF] = 0
        state[loops.CHUNK] = self._a.chunks
        state[loops.OP], state[loops.ROOT] = op, root
        state[loops.CALL_ID] = fingerprint - (1 << 64) if fingerprint >= 1 << 63 else fingerprint  # the 64 bits
        state[loops.NUMBER] = seq + 1
        state[loops.SPINS] = self._a.spins if bulk else self._a.small_spins  # long while cores are idle, else short
        return state

    def _drive(
        self,
        step: Callable[[Array], int],
        interpreted: Callable[[], None],
        deadline: float,
        fingerprint: int,
        seq: int,
        count: int,
        op: int = 0,
        root: int = -1,
        nbytes: int = 0,
    ) -> None:
        """Run a compiled loop of ``loops`` (``step(state)``) to the end, or, while it is
        not compiled for these arrays, ``interpreted()``: the same protocol in Python. A call
        without elements (``count`` 0) still meets every rank and checks its call.
        ``nbytes``: what it moves per rank (more than a chunk: a bulk transfer)."""
        if count == 0:
            self._sync(deadline, fingerprint, seq)
            return
        try:
            bulk = nbytes > self._a.chunk
            status = step(self._start(fingerprint, seq, op, root, bulk))
        except NotCompiled as missing:
            prepare([(missing.front, missing.types)])
            interpreted()
            return
        self._resume(step, status, deadline, fingerprint, seq, bulk)

    def _resume(
        self, step: Callable[[Array], int], status: int, deadline: float, fingerprint: int, seq: int, bulk: bool = True
    ) -> None:
        """Carry a compiled loop that returned ``status`` on to the end, doing for it what
        needs Python: sleeping in a wait, waking a sleeping peer, raising a mismatch.
        ``bulk``: the loop moves many chunks (see ``SpinPolicy.spins``)."""
        a, state = self._a, self._state
        try:
            while status != loops.DONE:
                which = int(state[loops.WHICH])
                ranks = range(int(state[loops.FIRST]), int(state[loops.STOP]))
                if status == loops.WAIT:
                    a.wait(which, int(state[loops.TARGET]), deadline, self._health, ranks, bulk)
                    state[loops.SPINS] = a.spins if bulk else a.small_spins
                elif status == loops.WAKE:
                    a.wake(which)
                else:
                    a.check_call(ranks, int(state[loops.SLOT]), fingerprint, seq)  # raises the mismatch
                    raise AssertionError("the compiled loop saw a mismatch that check_call does not")
                status = step(state)
        finally:
            a.chunks = int(state[loops.CHUNK])

    def broadcast(self, x: Array, root: int, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0) -> None:
        a = self._a
        self._per(dt)
        flat = x.view(np.uint8)
        data, words = a.data, a.words
        self._drive(
            lambda state: BROADCAST(flat, data, words, state),
            lambda: stepwise.broadcast(a, self._health, flat, root, deadline, fingerprint, seq),
            deadline,
            fingerprint,
            seq,
            flat.shape[0],
            root=root,
            nbytes=flat.nbytes,
        )

    def all_gather(self, x: Array, out: Array, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0) -> None:
        a = self._a
        self._per(dt)
        flat, whole = x.view(np.uint8), out.view(np.uint8)
        data, words = a.data, a.words
        self._drive(
            lambda state: ALL_GATHER(flat, whole, data, words, state),
            lambda: stepwise.all_gather(a, self._health, flat, whole, deadline, fingerprint, seq),
            deadline,
            fingerprint,
            seq,
            flat.shape[0],
            nbytes=flat.nbytes,
        )

    def reduce_scatter(
        self, blocks: Array, out: Array, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        """Per chunk: a rank copies into its slot the parts other ranks reduce, then reduces
        its own part from its input and the peers' slots straight into ``out``."""
        divisor = op.divisor(self._a.world)
        n = out.shape[0]
        self._per(dt, parts=self._a.world)
        pairwise = pairwise_opcode(dt, op)
        if pairwise is not None and not np.may_share_memory(out, blocks):
            view, opcode = pairwise
            ins, outs = (blocks, out) if view is None else (blocks.view(view), out.view(view))
            data, words = self._a.data, self._a.words
            self._drive(
                lambda state: REDUCE_SCATTER(ins, outs, data, words, state, divisor),
                lambda: self._reduce_scatter_steps(blocks, out, dt, op, deadline, fingerprint, seq),
                deadline,
                fingerprint,
                seq,
                n,
                opcode,
                nbytes=blocks.nbytes,
            )
            return
        if n == 0:
            self._sync(deadline, fingerprint, seq)
            return
        self._reduce_scatter_steps(blocks, out, dt, op, deadline, fingerprint, seq)

    def _reduce_scatter_steps(
        self, blocks: Array, out: Array, dt: DType, op: ReduceOp, deadline: float, fingerprint: int, seq: int
    ) -> None:
        """``stepwise.reduce_scatter`` (float16/bfloat16, an ``out`` inside ``blocks``, or the
        compiled loop not ready); every rank takes it for float16/bfloat16: ``reducer``'s bits."""
        p = self._a.world
        divisor = op.divisor(p)
        per = self._per(dt, parts=p)
        stepwise.reduce_scatter(
            self._a, self._health, blocks, out, reducer(dt, op), divisor, per, deadline, fingerprint, seq
        )

    def gather(
        self, x: Array, out: Array | None, root: int, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        """Per chunk: every rank copies its part into its slot; the root copies all out.
        On the last chunk every rank checks every rank's call (see ``broadcast``)."""
        per = self._per(dt)
        if x.shape[0] == 0:
            self._sync(deadline, fingerprint, seq)
            return
        stepwise.gather(self._a, self._health, x, out, root, per, deadline, fingerprint, seq)

    def scatter(
        self, blocks: Array | None, x: Array, root: int, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        """Per chunk: the root copies every rank's part into its slot, each rank copies its
        own out. On the last chunk every rank checks every rank's call (see ``broadcast``)."""
        per = self._per(dt, parts=self._a.world)
        if x.shape[0] == 0:
            self._sync(deadline, fingerprint, seq)
            return
        stepwise.scatter(self._a, self._health, blocks, x, root, per, deadline, fingerprint, seq)

    def barrier(self, deadline: float, fingerprint: int = 0, seq: int = 0) -> None:
        """Every rank shows up, in the same call (a barrier never passes a peer in another
        collective: it is a chunk without data)."""
        self._sync(deadline, fingerprint, seq)


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
        host = this_host()
        store.set(f"ferrodist/shm/host/{rank}", host, timeout=rdv.left())
        hosts = {rdv.get(f"ferrodist/shm/host/{r}", r, "said which host it is on").decode() for r in range(world)}
        if len(hosts) > 1:
            raise BackendUnavailable(
                f"rank {rank}: the shm backend needs every rank on one host, but they are on {len(hosts)}; "
                "use backend='tcp' (or 'auto')"
            )
        size = Arena.size(world, chunk, slots)
        if rank == 0:
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
            their_chunk, their_slots, address = (
                rdv.get("ferrodist/shm/segment", 0, "created the shared memory").decode().split(" ", 2)
            )
        except PeerLost as exc:
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
            for error in list(self._lost.values()):
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
        lost, aborts = self._lost, self._aborts

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
