"""``ShmCollectives``: the world's collectives through a single-host job's shared-memory
``Arena``: data is cut into chunks, each chunk passes through small slots that are reused, so
it stays in cache between the rank that writes it and the ranks that read it, and the
reductions read all ranks' slots in one fused pass.

Each collective runs its compiled loop (``loops``, called through ``fronts``) or, while that
is not compiled for its arrays, the same protocol step by step in Python (``stepwise``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ferrodist.core import DType, InvalidArgument, ReduceOp, bfloat16, reducer
from ferrodist.core.kernels import Twin, pairwise_opcode, plan, through_bfloat16

from . import loops, stepwise
from .arena import Arena
from .fronts import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER, ROUNDED, SMALL, SMALL_START, small_first
from .shared import Exchange, Shared

__all__ = ["IN_PLACE", "IN_PLACE_BYTES", "IN_PLACE_UP_TO", "SMALL_ALL_REDUCE", "ShmCollectives"]

Array = np.ndarray[Any, Any]
#: A collective bound to its dtype and op: ``call(x, deadline, fingerprint, seq)``.
SmallCall = Callable[[Array, float, int, int], None]

#: all_reduce moves at most this many bytes (size x ranks) the one-sync way, in which every
#: rank reduces everything; above it the pipeline (each rank reduces 1/p) is faster here.
SMALL_ALL_REDUCE = 32 << 10
#: all_reduce of an array in the group's shared buffers (``allocate``) from ``IN_PLACE_BYTES``
#: to ``IN_PLACE_UP_TO`` bytes reads the peers' arrays in place. Below, the slots' one
#: compiled call is faster than the in-place steps' waits (256 KiB: 26.7 us in place, 13.7
#: through the slots); above, the slots' pipeline, whose chunks stay in cache, is (32 MiB:
#: 3.64 ms in place, 2.23 through the slots); in between, in place is faster (8 MiB:
#: 197 us against 343). 2 ranks, ``ferrodist bench --backends shm,shm-shared``.
IN_PLACE_BYTES = 1 << 20
IN_PLACE_UP_TO = 16 << 20
#: What an in-place all_reduce adds to its call's fingerprint: the bits of a root, which an
#: all_reduce has none of (``ferrodist.collectives``' fingerprints describe it in words).
IN_PLACE = 0x7FF << 39


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
        self._rounding: Array | None = None  # a chunk of bfloat16 for ``loops.all_reduce_rounded``
        self.shared = Shared(arena.rank, arena.world)
        # (dtype, op) -> the one-slot all_reduce bound to them (``_bind_small``)
        self._smalls: dict[tuple[DType, ReduceOp], SmallCall] = {}
        self._state[loops.ME], self._state[loops.RANKS] = arena.rank, arena.world
        self._state[loops.SLOTS], self._state[loops.BYTES] = arena.slots, arena.chunk
        self._state[loops.SPINS] = arena.spins
        self.all_reduce_up_to = 1 << 62  # the arena is the fastest way at every size
        #: the sizes (bytes, both included) at which an all_reduce of an array in the shared
        #: buffers reads the peers' arrays in place
        self.in_place_bytes = (IN_PLACE_BYTES, IN_PLACE_UP_TO)
        # the most bytes per rank an all_reduce moves the one-slot way (size x ranks at most
        # two chunks and ``SMALL_ALL_REDUCE``)
        self._small_bytes = min(2 * arena.chunk, SMALL_ALL_REDUCE) // arena.world
        # Each collective's compiled loop (driven from Python) and the same protocol step by step.
        self.twins = {
            "all_reduce": Twin(self._chunks_compiled, self._chunks_stepwise),
            "all_reduce_rounded": Twin(self._rounded_compiled, self._rounded_stepwise),
            "broadcast": Twin(self._broadcast_compiled, self._broadcast_stepwise),
            "all_gather": Twin(self._all_gather_compiled, self._all_gather_stepwise),
            "reduce_scatter": Twin(self._reduce_scatter_compiled, self._reduce_scatter_steps),
        }
        self._chunks = self.twins["all_reduce"].call
        self._rounded = self.twins["all_reduce_rounded"].call
        self._broadcast = self.twins["broadcast"].call
        self._all_gather = self.twins["all_gather"].call
        self._reduce_scatter = self.twins["reduce_scatter"].call

    @property
    def size(self) -> int:
        return self._a.world

    def supports(self, dt: DType, op: ReduceOp | None = None) -> bool:
        return True

    def free(self) -> None:
        """Unmap the group's shared buffers and drop what holds views of the arena (the
        arena belongs to the transport)."""
        self.shared.close()
        self._smalls.clear()
        self._plans.clear()

    def allocate(self, nbytes: int, exchange: Exchange) -> Array:
        """``nbytes`` zero bytes (uint8) in memory every rank of the group maps, which the
        collectives read in place (``Shared.allocate``; a collective)."""
        return self.shared.allocate(nbytes, exchange)

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
        if 0 < x.nbytes <= self._small_bytes:
            small = self._smalls.get((dt, op)) or self._bind_small(dt, op)
            small(x, deadline, fingerprint, seq)
        elif (
            self.in_place_bytes[0] <= x.nbytes <= self.in_place_bytes[1] and (where := self.shared.find(x)) is not None
        ):
            buffer, offset = where
            peers = self.shared.peers(x, buffer, offset)
            place, words = self.shared.place(buffer, offset)
            fold, divisor = self._fold(dt, op), op.divisor(self._a.world)
            # marked: a rank whose array is an ordinary one takes the slots, and the calls differ
            mark = fingerprint | IN_PLACE if fingerprint else 0
            stepwise.all_reduce_in_place(
                self._a, self._health, x, peers, place, words, fold, divisor, deadline, mark, seq
            )
        else:
            self._reduce_chunks(x, dt, op, deadline, fingerprint, seq, root=None)

    def all_reduce_compressed(
        self, x: Array, wire: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        """all_reduce of the float32 array ``x`` in bfloat16 (``wire``): what ``all_reduce``
        of ``x`` rounded to bfloat16 does, on the same path and to the bit (so a rank that
        passes the rounded array itself meets this call), with the widened result left in
        ``x``. Above the one-slot size the chunk loop rounds each element on its way into a
        slot and widens it on its way back (``loops.all_reduce_rounded``): ``x`` is read
        once and written once, and the slots move half float32's bytes."""
        if wire is not bfloat16 or x.dtype != np.float32:
            raise InvalidArgument(f"shared memory: compressed all_reduce is float32 through bfloat16, not {wire.name}")
        if self._a.world > 1 and 2 * x.shape[0] > self._small_bytes:
            self._rounded(x, op, deadline, fingerprint, seq)
        else:
            through_bfloat16(x, lambda bits: self.all_reduce(bits, wire, op, deadline, fingerprint, seq))

    def bound_all_reduce(self, dt: DType, op: ReduceOp, count: int) -> SmallCall | None:
        """An all_reduce of ``count`` elements of ``dt`` with ``op``, bound to them once:
        ``call(x, deadline, fingerprint, seq)`` for a flat array ``x`` of them, which does
        what ``all_reduce`` does and looks nothing up (None where that is the general path:
        above the one-slot size)."""
        if not 0 < count * dt.itemsize <= self._small_bytes:
            return None
        return self._smalls.get((dt, op)) or self._bind_small(dt, op)

    def _bind_small(self, dt: DType, op: ReduceOp) -> SmallCall:
        """The one-slot all_reduce of ``dt`` with ``op``: its compiled loop (its start, and its
        resumption from Python when it returns a wait or a wake-up for a peer) and the same
        protocol step by step, as one ``Twin``, with everything but the call's own values bound."""
        a, state, data, words = self._a, self._state, self._a.data, self._a.words

        def stepwise_call(x: Array, deadline: float, fingerprint: int, seq: int) -> None:
            views, fold, divisor = self._small_plan(dt, op, x.shape[0])
            stepwise.all_reduce_slot(a, self._health, x, views, fold, divisor, deadline, fingerprint, seq)

        small = self._small_kind(dt, op)
        if not small:  # one rank: the same protocol in Python
            self._smalls[(dt, op)] = stepwise_call
            return stepwise_call
        view, opcode, divisor, half = small
        resume = self._resume

        def compiled(x: Array, deadline: float, fingerprint: int, seq: int) -> None:
            flat = x if view is None else x.view(view)
            call_id = fingerprint - (1 << 64) if fingerprint >= 1 << 63 else fingerprint  # its 64 bits
            state[loops.SPINS] = a.small_spins
            status = SMALL_START(flat, data, words, state, divisor, a.chunks, opcode, half, call_id, seq + 1)
            if status == loops.DONE:  # the common case: no Python wait, no wake-up
                a.chunks = int(state[loops.CHUNK])
                return
            resume(lambda state: SMALL(flat, data, words, state, divisor), status, deadline, fingerprint, seq, False)

        call = self._smalls[(dt, op)] = Twin(compiled, stepwise_call, queue=small_first).call
        return call

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
        p = self._a.world
        self._per(dt)  # the chunk must hold an element
        if p > 1 and x.shape[0] == 0:
            self._sync(deadline, fingerprint, seq)
        elif p > 1:
            self._chunks(x, dt, op, deadline, fingerprint, seq, root)
        else:
            reducer(dt, op)(x, [x], op.divisor(p))  # one rank: its own data, as the kernels round it

    def _chunks_compiled(
        self, x: Array, dt: DType, op: ReduceOp, deadline: float, fingerprint: int, seq: int, root: int | None
    ) -> None:
        view = self._small_kind(dt, op)[0]
        self._drive(ALL_REDUCE, x if view is None else x.view(view), dt, op, deadline, fingerprint, seq, root)

    def _chunks_stepwise(
        self, x: Array, dt: DType, op: ReduceOp, deadline: float, fingerprint: int, seq: int, root: int | None
    ) -> None:
        fold = self._fold(dt, op)
        stepwise.all_reduce(self._a, self._health, x, fold, op.divisor(self._a.world), root, deadline, fingerprint, seq)

    def _rounded_compiled(self, x: Array, op: ReduceOp, deadline: float, fingerprint: int, seq: int) -> None:
        if self._rounding is None:
            self._rounding = np.empty(self._a.chunk // 2, np.uint16)
        rounding = self._rounding
        self._drive(ROUNDED, x, bfloat16, op, deadline, fingerprint, seq, None, rounding)

    def _rounded_stepwise(self, x: Array, op: ReduceOp, deadline: float, fingerprint: int, seq: int) -> None:
        through_bfloat16(x, lambda bits: self._chunks_stepwise(bits, bfloat16, op, deadline, fingerprint, seq, None))

    def _drive(
        self,
        front: Any,
        flat: Array,
        dt: DType,
        op: ReduceOp,
        deadline: float,
        fingerprint: int,
        seq: int,
        root: int | None,
        *extra: Array,
    ) -> None:
        """Run the chunk loop ``front`` (``loops.all_reduce``, or ``all_reduce_rounded`` with
        its buffer in ``extra``) over ``flat``, whose elements the slots hold as ``dt``, to
        the end."""
        a = self._a
        divisor = op.divisor(a.world)
        _, opcode, _, half = self._small_kind(dt, op)
        data, words = a.data, a.words
        bulk = flat.shape[0] * dt.itemsize > a.chunk
        state = self._start(fingerprint, seq, opcode, -1 if root is None else root, bulk)
        state[loops.HALF] = half
        step = lambda state: front(flat, *extra, data, words, state, divisor)  # noqa: E731
        self._resume(step, step(state), deadline, fingerprint, seq, bulk)

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

    def _run(
        self,
        step: Callable[[Array], int],
        deadline: float,
        fingerprint: int,
        seq: int,
        op: int = 0,
        root: int = -1,
        nbytes: int = 0,
    ) -> None:
        """Run a compiled loop of ``loops`` (``step(state)``) to the end; its first step raises
        ``NotCompiled`` before anything runs where the loop is not compiled for these arrays
        (its ``Twin`` then runs the protocol step by step). ``nbytes``: what it moves per rank
        (more than a chunk: a bulk transfer)."""
        bulk = nbytes > self._a.chunk
        self._resume(step, step(self._start(fingerprint, seq, op, root, bulk)), deadline, fingerprint, seq, bulk)

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
        self._per(dt)
        flat = x.view(np.uint8)
        if flat.shape[0] == 0:  # a call without elements still meets every rank and checks its call
            self._sync(deadline, fingerprint, seq)
            return
        self._broadcast(flat, root, deadline, fingerprint, seq)

    def _broadcast_compiled(self, flat: Array, root: int, deadline: float, fingerprint: int, seq: int) -> None:
        data, words = self._a.data, self._a.words
        step = lambda state: BROADCAST(flat, data, words, state)  # noqa: E731
        self._run(step, deadline, fingerprint, seq, root=root, nbytes=flat.nbytes)

    def _broadcast_stepwise(self, flat: Array, root: int, deadline: float, fingerprint: int, seq: int) -> None:
        stepwise.broadcast(self._a, self._health, flat, root, deadline, fingerprint, seq)

    def all_gather(self, x: Array, out: Array, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0) -> None:
        self._per(dt)
        flat, whole = x.view(np.uint8), out.view(np.uint8)
        if flat.shape[0] == 0:
            self._sync(deadline, fingerprint, seq)
            return
        self._all_gather(flat, whole, deadline, fingerprint, seq)

    def _all_gather_compiled(self, flat: Array, whole: Array, deadline: float, fingerprint: int, seq: int) -> None:
        data, words = self._a.data, self._a.words
        step = lambda state: ALL_GATHER(flat, whole, data, words, state)  # noqa: E731
        self._run(step, deadline, fingerprint, seq, nbytes=flat.nbytes)

    def _all_gather_stepwise(self, flat: Array, whole: Array, deadline: float, fingerprint: int, seq: int) -> None:
        stepwise.all_gather(self._a, self._health, flat, whole, deadline, fingerprint, seq)

    def reduce_scatter(
        self, blocks: Array, out: Array, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        """Per chunk: a rank copies into its slot the parts other ranks reduce, then reduces
        its own part from its input and the peers' slots straight into ``out``."""
        self._per(dt, parts=self._a.world)
        if out.shape[0] == 0:
            self._sync(deadline, fingerprint, seq)
        elif pairwise_opcode(dt, op) is not None and not np.may_share_memory(out, blocks):
            self._reduce_scatter(blocks, out, dt, op, deadline, fingerprint, seq)
        else:
            self._reduce_scatter_steps(blocks, out, dt, op, deadline, fingerprint, seq)

    def _reduce_scatter_compiled(
        self, blocks: Array, out: Array, dt: DType, op: ReduceOp, deadline: float, fingerprint: int, seq: int
    ) -> None:
        pairwise = pairwise_opcode(dt, op)
        assert pairwise is not None
        view, opcode = pairwise
        ins, outs = (blocks, out) if view is None else (blocks.view(view), out.view(view))
        data, words, divisor = self._a.data, self._a.words, op.divisor(self._a.world)
        step = lambda state: REDUCE_SCATTER(ins, outs, data, words, state, divisor)  # noqa: E731
        self._run(step, deadline, fingerprint, seq, opcode, nbytes=blocks.nbytes)

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
