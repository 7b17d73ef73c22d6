"""The two-level route: runs the world's collectives of a job that spans nodes from their plans
(``steps``): steps inside each node (shared memory), between nodes (the world's tcp
transport) and copies here.

Each call is one call of the world group: one number, one deadline, one abort. Its steps
carry the call's number; each step has a fingerprint of its own (its operation, dtype,
count and op) and a tag of its own (the call's tag with the step's number in bits 20..30
of the call-number field), so two steps never take each other's messages. Inside a node
the steps run through the node's shared-memory arena; across nodes, every local rank drives
its own stream (one all_reduce per shard).

A failure in either level fails the world call, which aborts the world group as any
failed call does (its notices travel over tcp to every rank). Each rank bridges that
abort into its node's channel, so a rank held in a shared-memory step stops at once.
Errors from inside a node name global ranks and the node; a lost peer on another node
is named with its node and host.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from typing import Any

from ferrodist.collectives._algorithms import doubling, ring, tree
from ferrodist.collectives._call import Array, Call, collective_tag
from ferrodist.collectives._checks import Blocks
from ferrodist.collectives._debug import debugging_routes
from ferrodist.core import CollectiveMismatch, CollectiveTimeout, DType, FerrodistError, PeerLost, ReduceOp, reducer
from ferrodist.transport import Transport

from .plan import Nodes
from .steps import Span, Step, StepPlan, plan_steps

__all__ = ["Levels", "in_global_ranks"]

_STEP_SHIFT = 20  # a step's number sits in bits 20..30 of the call-number field of its tag
#: The most step plans a world keeps; past it the table starts again.
_MAX_PLANS = 256

Body = Callable[..., None]


class Levels:
    """The world group's two levels on this rank: where the ranks run (``nodes``), the world's
    transport (between nodes) and the node's (``inner``, ranks numbered 0..L-1 inside the
    node; None on a node of one rank)."""

    def __init__(
        self, nodes: Nodes, world: Transport, channel: int, inner: Transport | None, hosts: Sequence[str] = ()
    ) -> None:
        self.nodes = nodes
        self.world = world
        self.channel = channel
        self.me = world.rank
        self.node, self.local = nodes.place(self.me)
        self.members = nodes.members[self.node]
        self.hosts = tuple(hosts)
        self.inner = inner
        self.native = inner.native_collectives(range(len(self.members)), channel) if inner is not None else None
        self.show = debugging_routes()
        self._plans: dict[tuple[Any, ...], Bound] = {}

    def __str__(self) -> str:
        where = f" ({self.hosts[self.node]})" if self.hosts else ""
        return f"two levels: {self.nodes}; this rank is local rank {self.local} of node {self.node}{where}"

    def plan(
        self, operation: str, dt: DType | None, count: int, op: ReduceOp | None = None, root: int | None = None
    ) -> StepPlan:
        """This rank's steps for a kind of call (``steps.plan_steps``), made once and kept;
        ``FERRODIST_DEBUG=route`` prints each when it is made."""
        return self._bound(operation, dt, count, op, root).plan

    def _bound(self, operation: str, dt: DType | None, count: int, op: ReduceOp | None, root: int | None) -> Bound:
        key = (operation, dt, count, op, root)
        bound = self._plans.get(key)
        if bound is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            plan = plan_steps(self.nodes, self.me, self.native is not None, operation, dt, count, op, root)
            bound = self._plans[key] = Bound(self, plan, count)
            if self.show:
                print(f"[ferrodist] {plan}", flush=True)
        return bound

    def body(self, operation: str, dt: DType | None, op: ReduceOp | None, root: int | None) -> Body:
        """The body of one kind of call (as ``_route`` gives them: ``body(call, *arrays)``): its
        plan for the call's count, bound once (``Bound``), run."""
        bounds: dict[int, Bound] = {}

        def bound(count: int) -> Bound:
            found = bounds.get(count)
            if found is None:
                if len(bounds) >= _MAX_PLANS:
                    bounds.clear()
                found = bounds[count] = self._bound(operation, dt, count, op, root)
            return found

        if operation == "barrier":
            return lambda call: bound(0).run(call, None, None)
        if operation in ("all_reduce", "broadcast", "reduce"):
            return lambda call, x: bound(x.shape[0]).run(call, x, None)
        if operation in ("all_gather", "reduce_scatter"):
            return lambda call, x, blocks: bound(x.shape[0]).run(call, x, blocks)
        raise AssertionError(f"the two levels do not run {operation}")

    # -- the steps ---------------------------------------------------------------------------------
    def _inside(self, call: Call, step: Step, dt: Any, x: Any, out: Any) -> None:
        """A step among the node's ranks: through the arena, or our algorithm over the node's transport."""
        fp = step.fingerprint
        operation = step.operation
        native = self.native
        if native is not None:
            if operation == "all_reduce":
                native.all_reduce(x, dt, step.reduce_op, call.deadline, fp, call.seq)
            elif operation == "reduce_scatter":
                native.reduce_scatter(x, out, dt, step.reduce_op, call.deadline, fp, call.seq)
            elif operation == "all_gather":
                native.all_gather(x, out, dt, call.deadline, fp, call.seq)
            elif operation == "broadcast":
                native.broadcast(x, step.at, dt, call.deadline, fp, call.seq)
            elif operation == "reduce":
                native.reduce(x, step.at, dt, step.reduce_op, call.deadline, fp, call.seq)
            else:
                native.barrier(call.deadline, fp, call.seq)
            return
        assert self.inner is not None
        tag = collective_tag(self.channel, call.seq) ^ (step.number << _STEP_SHIFT)
        sub = Call(self.inner, range(len(step.ranks)), step.index, tag, call.deadline, call.scratch, fp, call.seq)
        if operation == "all_reduce":
            ring.all_reduce(sub, x, reducer(dt, step.reduce_op), 1.0)
        elif operation == "reduce_scatter":
            ring.reduce_scatter(sub, out, Blocks.of(x, len(step.ranks)), reducer(dt, step.reduce_op), 1.0)
        elif operation == "all_gather":
            blocks = Blocks.of(out, len(step.ranks))
            blocks[step.index][...] = x
            ring.all_gather(sub, blocks)
        elif operation == "broadcast":
            tree.broadcast(sub, x, step.at)
        elif operation == "reduce":
            tree.reduce(sub, x, step.at, reducer(dt, step.reduce_op), 1.0)
        else:
            tree.barrier(sub)

    def _across(self, call: Call, step: Step, dt: Any, x: Any, out: Any, parts: list[Any]) -> None:
        """A step among one rank per node over the world's transport (a swap is bound in ``Bound``)."""
        tag = call.tag ^ (step.number << _STEP_SHIFT)
        algorithm = step.algorithm
        c = Call(self.world, step.ranks, step.index, tag, call.deadline, call.scratch, step.fingerprint, call.seq)
        if step.operation == "all_reduce":
            run = ring.all_reduce if algorithm == "ring" else doubling.all_reduce
            run(c, x, reducer(dt, step.reduce_op), step.divisor)
        elif step.operation == "broadcast":
            tree.broadcast(c, x, step.at)
        elif step.operation == "reduce":
            tree.reduce(c, x, step.at, reducer(dt, step.reduce_op), step.divisor)
        elif step.operation == "reduce_scatter":
            ring.reduce_scatter(c, out, Blocks.of(x, len(step.ranks)), reducer(dt, step.reduce_op), step.divisor)
        elif step.operation == "all_gather":
            others = [k for k in range(len(step.ranks)) if k != step.index]
            pending = [c.irecv(parts[k], k) for k in others]
            c.wait_all(pending + [c.isend(x, k) for k in others])
        else:
            tree.barrier(c)

    # -- failure -------------------------------------------------------------------------------
    def bridge(self, error: FerrodistError, seq: int) -> None:
        """The world group was aborted (here or by a peer): stop this rank's steps inside the node."""
        if self.inner is not None and self.inner.aborted(self.channel) is None:
            self.inner.abort(self.channel, error, peers=[], seq=seq)

    def failed(self, exc: FerrodistError, seq: int, *, inside: bool) -> FerrodistError:
        """The error a call raises when one of its steps failed (``inside``: a step inside the
        node): a peer's abort of the world as it came, else this rank's error with global
        ranks and the node of the rank it names. Steps inside the node stop here too (the
        world's abort follows in the runner)."""
        aborted = self.world.aborted(self.channel)
        if aborted is not None and aborted.aborted_by is not None:
            self.bridge(aborted, seq)
            return copy.copy(aborted)
        error = self._globally(exc) if inside and exc.aborted_by is None else exc
        peer = error.peer if isinstance(error, (PeerLost, CollectiveMismatch)) else None
        if isinstance(peer, int) and 0 <= peer < self.nodes.world_size:
            error = copy.copy(error)
            error.args = (f"{error.message} ({self.where(peer)})",)
        self.bridge(error, seq)
        return error

    def where(self, rank: int) -> str:
        """Which node rank ``rank`` runs on, in words."""
        node, _ = self.nodes.place(rank)
        host = f", host {self.hosts[node].split('/')[0]}" if self.hosts else ""
        return f"rank {rank} runs on node {node} with ranks {list(self.nodes.members[node])}{host}"

    def _globally(self, exc: FerrodistError) -> FerrodistError:
        """An error of the node's transport (local ranks) in global ranks. A peer of the node
        that closed its transport after a failure passes that failure on in its own words (a
        failure of the world: global ranks already), which stay as they are, culprit included."""
        members = self.members
        error = copy.copy(exc)
        told_by = getattr(exc, "told_by", None)
        if isinstance(error, (PeerLost, CollectiveMismatch)):
            peer = error.peer
            if isinstance(peer, int) and 0 <= peer < len(members) and (told_by is None or peer == told_by):
                error.peer = members[peer]
        if isinstance(error, CollectiveTimeout) and error.waiting_for:
            error.waiting_for = tuple(members[r] for r in error.waiting_for if 0 <= r < len(members))
        error.rank = self.me
        own, passed_on = exc.message, ""
        if told_by is not None and _PASSED_ON in own:
            own, passed_on = own.split(_PASSED_ON, 1)
            passed_on = _PASSED_ON + passed_on
        error.args = (f"inside node {self.node} (ranks {list(members)}): {in_global_ranks(own, members)}{passed_on}",)
        return error

    def close(self) -> None:
        inner, self.inner = self.inner, None
        if self.native is not None:
            self.native.free()
            self.native = None
        if inner is not None:
            inner.close()


#: What a step reads or writes on one call: ``(x, blocks, scratch) -> array``.
Where = Callable[[Any, Any, Any], Any]
#: One step bound to its plan: ``(call, x, blocks, scratch) -> None``.
StepCall = Callable[[Call, Any, Any, Any], None]


class Bound:
    """A plan made into calls once: each step with its spans, reducer, tag and fingerprint
    worked out, so that running a known kind of call only calls (``run``).

    ``count``: the elements of the call's tensor (of each block, for all_gather and
    reduce_scatter), which the plan was made for."""

    def __init__(self, levels: Levels, plan: StepPlan, count: int) -> None:
        self.levels = levels
        self.plan = plan
        self.count = count
        self.sizes = dict(plan.scratch)
        self.calls = tuple((self._step(step), step.level == "node") for step in plan.steps)

    def run(self, call: Call, x: Array | None, blocks: Blocks | None) -> None:
        """Run the plan's steps in order on the call's tensor ``x`` (and ``blocks``)."""
        scratch = None
        if self.sizes and x is not None:
            scratch = {slot: call.scratch.get(slot, n, x.dtype) for slot, n in self.sizes.items()}
        for step, inside in self.calls:
            try:
                step(call, x, blocks, scratch)
            except FerrodistError as exc:
                raise self.levels.failed(exc, call.seq, inside=inside) from None

    def _where(self, span: Span | None) -> Where:
        if span is None:
            return lambda x, blocks, scratch: None
        name, start, end = span.buffer, span.start, span.start + span.count
        if name == "x":
            whole = self.count
            if start == 0 and end == whole:
                return lambda x, blocks, scratch: x
            return lambda x, blocks, scratch: x[start:end]
        kind, number = name.split()
        k = int(number)
        if kind == "block":
            if start == 0 and end == self.count:
                return lambda x, blocks, scratch: blocks[k]
            return lambda x, blocks, scratch: blocks[k][start:end]
        assert kind == "scratch", span
        if start == 0 and end == self.sizes[k]:
            return lambda x, blocks, scratch: scratch[k]
        return lambda x, blocks, scratch: scratch[k][start:end]

    def _step(self, step: Step) -> StepCall:
        levels, dt = self.levels, self.plan.dtype
        data, out = self._where(step.data), self._where(step.out)
        if step.level == "here":

            def copy(call: Call, x: Any, blocks: Any, scratch: Any) -> None:
                out(x, blocks, scratch)[...] = data(x, blocks, scratch)

            return copy
        if step.level == "node":
            if levels.native is not None and step.operation == "all_reduce" and dt is not None:
                op, fp = step.reduce_op, step.fingerprint

                def node_all_reduce(call: Call, x: Any, blocks: Any, scratch: Any) -> None:
                    native = levels.native
                    assert native is not None, "the two levels were closed"
                    native.all_reduce(data(x, blocks, scratch), dt, op, call.deadline, fp, call.seq)

                return node_all_reduce
            return lambda call, x, blocks, scratch: levels._inside(
                call, step, dt, data(x, blocks, scratch), out(x, blocks, scratch)
            )
        if step.algorithm == "swap":
            peer, tag_bits, fp = step.ranks[1 - step.index], step.number << _STEP_SHIFT, step.fingerprint
            reduce, divisor, first = reducer(dt, step.reduce_op), step.divisor, step.index == 0
            world = levels.world

            def swap(call: Call, x: Any, blocks: Any, scratch: Any) -> None:
                mine = data(x, blocks, scratch)
                incoming = call.scratch.get(0, mine.shape[0], mine.dtype)
                world.sendrecv(
                    mine, peer, incoming, peer, call.tag ^ tag_bits, timeout=call.remaining(), fingerprint=fp
                )
                # the lower index's data first (as recursive doubling does), so both get the same bits
                reduce(mine, (mine, incoming) if first else (incoming, mine), divisor)

            return swap
        parts = tuple(self._where(part) for part in step.parts)
        return lambda call, x, blocks, scratch: levels._across(
            call,
            step,
            dt,
            data(x, blocks, scratch),
            out(x, blocks, scratch),
            [part(x, blocks, scratch) for part in parts],
        )


#: Where a node peer's message passes on the failure that made it leave (``_aborts.departure``).
_PASSED_ON = " after a failure there: "
#: "rank 1", "ranks [0, 1]" in a message of the node's transport (not "group rank 1", "local rank 1").
_RANK_WORDS = re.compile(r"(?<![\w-])(?<!group )(?<!local )(ranks?) (\[[\d, ]*\]|\d+)(?!\w)")


def in_global_ranks(text: str, members: Sequence[int]) -> str:
    """``text``, a message of a node's transport (whose ranks are the node's, numbered 0..L-1),
    with every rank it names by its global number: "rank 1 went away" inside the node of
    ranks [2, 3] says "rank 3 went away"."""

    def one(said: re.Match[str]) -> str:
        word, number = said.group(1), said.group(2)
        if number.startswith("["):
            local = [int(part) for part in number[1:-1].split(",") if part.strip()]
            if all(0 <= n < len(members) for n in local):
                return f"{word} {[members[n] for n in local]}"
            return said.group(0)
        n = int(number)
        return f"{word} {members[n]}" if 0 <= n < len(members) else said.group(0)

    return _RANK_WORDS.sub(one, text)
