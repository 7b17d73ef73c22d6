"""The two-level route: the world's collectives of a job that spans nodes, run as a step
inside each node (shared memory), a step between nodes (the world's tcp transport) and,
where the result is needed everywhere, a step inside the node again (see ``plan``).

Each call is one call of the world group: one number, one deadline, one abort. Its steps
carry the call's number; each step has a fingerprint of its own (its operation, dtype,
count and op) and a tag of its own (the call's tag with the step in bits 20..30 of the
call-number field), so two steps never take each other's messages. Inside a node the
steps run through the node's shared-memory arena; across nodes, every local rank drives
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

import numpy as np

from ferrodist.collectives._algorithms import doubling, ring, tree
from ferrodist.collectives._algorithms.select import SMALL_MESSAGE_BYTES, all_reduce_algorithm
from ferrodist.collectives._call import Array, Call, collective_tag
from ferrodist.collectives._checks import Blocks
from ferrodist.collectives._fingerprint import fingerprint
from ferrodist.core import DType, FerrodistError, ReduceOp, reducer
from ferrodist.transport import Transport

from .plan import LevelsPlan, Nodes, levels_plan

__all__ = ["OPERATIONS", "PAIRS_BYTES", "PIECE_BYTES", "SMALL_BYTES", "Levels", "Steps", "in_global_ranks"]


#: The operations the two levels run (the others run flat over the world's transport).
OPERATIONS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier")
#: all_reduce up to this many bytes is not cut into shards: it goes through local rank 0 of
#: each node (reduce inside, all_reduce of those across, broadcast inside), or up to
#: ``PAIRS_BYTES`` on nodes of equal size, an all_reduce inside the node and then each local
#: rank's with its peers on the other nodes (one wake-up less on the way; every byte crosses
#: the link once per local rank).
SMALL_BYTES = 64 * 1024
PAIRS_BYTES = 16 * 1024
#: A large all_reduce on nodes of equal size goes in pieces of at most this many bytes (each
#: its three steps), so that what a step inside the node writes is still in cache when the
#: next step reads it.
PIECE_BYTES = 4 << 20
_STEP_SHIFT = 20  # a step's number sits in bits 20..30 of the call-number field of its tag
_LEADERS = 0x7FF  # the step number of the leaders' cross-node step
#: Scratch slots of the steps (the algorithms use 0..2, the transport's own collectives 7).
_SHARD, _COPY, _NODE_BLOCKS, _REMOTE, _PACKED = 8, 9, 10, 11, 12

Body = Callable[..., None]
Reduce = Callable[[Array, Sequence[Array], float], None]


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
        self.leaders = tuple(m[0] for m in nodes.members)
        self.even = len({len(m) for m in nodes.members}) == 1
        self.peers = tuple(m[self.local] for m in nodes.members) if self.even else ()  # same local rank, each node
        self.shards = max(len(m) for m in nodes.members)
        self.world_size = nodes.world_size
        self._plans: dict[int, LevelsPlan] = {}

    def __str__(self) -> str:
        where = f" ({self.hosts[self.node]})" if self.hosts else ""
        return f"two levels: {self.nodes}; this rank is local rank {self.local} of node {self.node}{where}"

    def plan(self, count: int) -> LevelsPlan:
        plan = self._plans.get(count)
        if plan is None:
            if len(self._plans) > 256:
                self._plans.clear()
            plan = self._plans[count] = levels_plan(self.nodes, count, self.me)
        return plan

    def body(self, operation: str, dt: DType | None, op: ReduceOp | None, root: int | None) -> Body:
        """The body of one kind of call (as ``_route`` gives them: ``body(call, *arrays)``)."""
        if operation == "barrier":
            return lambda call: self._run(call, Steps.barrier)
        assert dt is not None
        if operation == "all_reduce":
            assert op is not None
            if len(self.nodes.members) == 2 and self.even:
                return self._pairs_all_reduce(dt, op)
            return lambda call, x: self._run(call, Steps.all_reduce, x, dt, op)
        if operation == "broadcast":
            assert root is not None
            return lambda call, x: self._run(call, Steps.broadcast, x, dt, root)
        if operation == "reduce":
            assert root is not None and op is not None
            return lambda call, x: self._run(call, Steps.reduce, x, dt, root, op)
        if operation == "all_gather":
            return lambda call, x, blocks: self._run(call, Steps.all_gather, x, dt, blocks)
        if operation == "reduce_scatter":
            assert op is not None
            return lambda call, out, blocks: self._run(call, Steps.reduce_scatter, out, dt, blocks, op)
        raise AssertionError(f"the two levels do not run {operation}")

    def _pairs_all_reduce(self, dt: DType, op: ReduceOp) -> Body:
        """all_reduce on two nodes of equal size: up to ``PAIRS_BYTES``, ``Steps``' node
        all_reduce (straight into the node's arena where it has one) and exchange with the
        peer node, with what depends only on the count worked out once (the fingerprints,
        the reduce): the same steps, tags and bits in fewer Python calls, which is most of
        a small call's time. Larger calls go through ``Steps.all_reduce``."""
        inside, reduce, divisor = (
            op.combine,
            reducer(dt, op),
            op.divisor(self.world_size),
        )
        prints: dict[int, tuple[int, int]] = {}
        mine = self.peers.index(self.me)
        peer = self.peers[1 - mine]

        def body(call: Call, x: Array) -> None:
            n = x.shape[0]
            if not (0 < x.nbytes <= PAIRS_BYTES and (x.nbytes <= SMALL_BYTES or n < self.shards)):  # as Steps decides
                self._run(call, Steps.all_reduce, x, dt, op)
                return
            fps = prints.get(n)
            if fps is None:
                if len(prints) > 256:
                    prints.clear()
                fps = prints[n] = (fingerprint("all_reduce", dt, n, inside), fingerprint("all_reduce", dt, n, op))
            try:
                if self.native is not None:
                    try:
                        self.native.all_reduce(x, dt, inside, call.deadline, fps[0], call.seq)
                    except FerrodistError as exc:
                        exc.inside_node = True  # type: ignore[attr-defined]
                        raise
                elif self.inner is not None:
                    Steps(self, call).node_all_reduce(x, dt, inside)
                swap(self.world, call, x, peer, mine, call.tag ^ (_LEADERS << _STEP_SHIFT), fps[1], reduce, divisor)
            except FerrodistError as exc:
                raise self.failed(exc, call.seq) from None

        return body

    def _run(self, call: Call, steps: Callable[..., None], *args: Any) -> None:
        try:
            steps(Steps(self, call), *args)
        except FerrodistError as exc:
            raise self.failed(exc, call.seq) from None

    # -- failure -------------------------------------------------------------------------------
    def bridge(self, error: FerrodistError, seq: int) -> None:
        """The world group was aborted (here or by a peer): stop this rank's steps inside the node."""
        if self.inner is not None and self.inner.aborted(self.channel) is None:
            self.inner.abort(self.channel, error, peers=[], seq=seq)

    def failed(self, exc: FerrodistError, seq: int) -> FerrodistError:
        """The error a call raises when one of its steps failed: a peer's abort of the world as
        it came, else this rank's error with global ranks and the node of the rank it names.
        Steps inside the node stop here too (the world's abort follows in the runner)."""
        aborted = self.world.aborted(self.channel)
        if aborted is not None and aborted.aborted_by is not None:
            self.bridge(aborted, seq)
            return copy.copy(aborted)
        error = self._globally(exc) if self.inner is not None and exc.aborted_by is None and _inner(exc) else exc
        peer = getattr(error, "peer", None)
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
        peer = getattr(exc, "peer", None)
        if isinstance(peer, int) and 0 <= peer < len(members) and (told_by is None or peer == told_by):
            error.peer = members[peer]  # type: ignore[attr-defined]
        waiting = getattr(exc, "waiting_for", ())
        if waiting:
            error.waiting_for = tuple(members[r] for r in waiting if 0 <= r < len(members))  # type: ignore[attr-defined]
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


def swap(
    world: Transport, call: Call, x: Array, peer: int, mine: int, tag: int, fp: int, reduce: Reduce, divisor: float
) -> None:
    """All_reduce ``x`` with ``peer`` over ``world``: one exchange, then the two reduced with
    the lower index's data first (as recursive doubling does; ``mine``: this rank's index, 0
    or 1), so both get the same bits."""
    incoming = call.scratch.get(0, x.shape[0], x.dtype)
    world.sendrecv(x, peer, incoming, peer, tag, timeout=call.remaining(), fingerprint=fp)
    reduce(x, (incoming, x) if mine else (x, incoming), divisor)


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


def _inner(exc: FerrodistError) -> bool:
    return bool(getattr(exc, "inside_node", False))


class Steps:
    """One call's steps on this rank (see the module's docstring)."""

    __slots__ = ("_call", "_lv", "_node_steps")

    def __init__(self, levels: Levels, call: Call) -> None:
        self._lv, self._call = levels, call
        self._node_steps = 0

    # -- the steps inside the node ---------------------------------------------------------------
    def _inside(self, run_native: Callable[[Any, int], None], run_ours: Callable[[Call], None], fp: int) -> None:
        """One step inside the node: through the arena when the node's transport has one, else
        our algorithm over the node's transport. Its errors are marked as the node's."""
        lv, call = self._lv, self._call
        self._node_steps += 1
        assert lv.inner is not None
        try:
            if lv.native is not None:
                run_native(lv.native, fp)
            else:
                tag = collective_tag(lv.channel, call.seq) ^ (self._node_steps << _STEP_SHIFT)
                sub = Call(lv.inner, range(len(lv.members)), lv.local, tag, call.deadline, call.scratch, fp, call.seq)
                run_ours(sub)
        except FerrodistError as exc:
            exc.inside_node = True  # type: ignore[attr-defined]
            raise

    def node_all_reduce(self, x: Array, dt: DType, op: ReduceOp) -> None:
        if self._lv.inner is None:
            return
        fp = fingerprint("all_reduce", dt, x.shape[0], op)
        self._inside(
            lambda n, f: n.all_reduce(x, dt, op, self._call.deadline, f, self._call.seq),
            lambda c: ring.all_reduce(c, x, reducer(dt, op), 1.0),
            fp,
        )

    def node_reduce_scatter(self, inp: Array, out: Array, dt: DType, op: ReduceOp) -> None:
        if self._lv.inner is None:
            out[...] = inp
            return
        fp = fingerprint("reduce_scatter", dt, out.shape[0], op)
        size = len(self._lv.members)
        self._inside(
            lambda n, f: n.reduce_scatter(inp, out, dt, op, self._call.deadline, f, self._call.seq),
            lambda c: ring.reduce_scatter(c, out, Blocks.of(inp, size), reducer(dt, op), 1.0),
            fp,
        )

    def node_all_gather(self, x: Array, out: Array, dt: DType) -> None:
        if self._lv.inner is None:
            out[...] = x
            return
        fp = fingerprint("all_gather", dt, x.shape[0])
        size, local = len(self._lv.members), self._lv.local

        def ours(c: Call) -> None:
            blocks = Blocks.of(out, size)
            blocks[local][...] = x
            ring.all_gather(c, blocks)

        self._inside(lambda n, f: n.all_gather(x, out, dt, self._call.deadline, f, self._call.seq), ours, fp)

    def node_broadcast(self, x: Array, root: int, dt: DType) -> None:
        if self._lv.inner is None:
            return
        fp = fingerprint("broadcast", dt, x.shape[0], root=root)
        self._inside(
            lambda n, f: n.broadcast(x, root, dt, self._call.deadline, f, self._call.seq),
            lambda c: tree.broadcast(c, x, root),
            fp,
        )

    def node_reduce(self, x: Array, root: int, dt: DType, op: ReduceOp) -> None:
        if self._lv.inner is None:
            return
        fp = fingerprint("reduce", dt, x.shape[0], op, root)
        self._inside(
            lambda n, f: n.reduce(x, root, dt, op, self._call.deadline, f, self._call.seq),
            lambda c: tree.reduce(c, x, root, reducer(dt, op), 1.0),
            fp,
        )

    def node_barrier(self) -> None:
        if self._lv.inner is None:
            return
        self._inside(
            lambda n, f: n.barrier(self._call.deadline, f, self._call.seq), tree.barrier, fingerprint("barrier")
        )

    # -- the steps between nodes ------------------------------------------------------------------
    def across(self, ranks: Sequence[int], step: int, fp: int) -> Call:
        """A step among ``ranks`` (global, one per node) over the world's transport."""
        call, me = self._call, self._lv.me
        tag = call.tag ^ (step << _STEP_SHIFT)
        return Call(self._lv.world, ranks, list(ranks).index(me), tag, call.deadline, call.scratch, fp, call.seq)

    def across_all_reduce(self, x: Array, ranks: Sequence[int], step: int, dt: DType, op: ReduceOp) -> None:
        lv = self._lv
        divisor = op.divisor(lv.world_size)
        fp = fingerprint("all_reduce", dt, x.shape[0], op)
        if len(ranks) == 2 and x.nbytes <= SMALL_MESSAGE_BYTES:  # two nodes: one exchange, as recursive doubling's
            mine = ranks.index(lv.me)
            tag = self._call.tag ^ (step << _STEP_SHIFT)
            swap(lv.world, self._call, x, ranks[1 - mine], mine, tag, fp, reducer(dt, op), divisor)
            return
        c = self.across(ranks, step, fp)
        run = ring.all_reduce
        if all_reduce_algorithm(x.nbytes, len(ranks), None, rank=lv.me) != "ring":
            run = doubling.all_reduce
        run(c, x, reducer(dt, op), divisor)

    # -- the collectives --------------------------------------------------------------------------
    def all_reduce(self, x: Array, dt: DType, op: ReduceOp) -> None:
        lv = self._lv
        inside = op.combine
        n, size = x.shape[0], len(lv.members)
        if x.nbytes <= SMALL_BYTES or n < lv.shards:
            self._leaders_all_reduce(x, dt, op)
            return
        if lv.even:
            group = lv.peers
            step = max(1, PIECE_BYTES // x.itemsize // size) * size  # elements per piece
            main = n // size * size
            for start in range(0, main, step):
                piece = x[start : min(main, start + step)]
                shard = self._call.scratch.get(_SHARD, piece.shape[0] // size, x.dtype)
                self.node_reduce_scatter(piece, shard, dt, inside)
                self.across_all_reduce(shard, group, 1 + lv.local, dt, op)
                self.node_all_gather(shard, piece, dt)
            if main < n:
                self._leaders_all_reduce(x[main:], dt, op)
            return
        plan = lv.plan(n)
        self.node_all_reduce(x, dt, inside)
        for s, group in zip(plan.owned, plan.across, strict=True):
            self.across_all_reduce(x[plan.span(s)], group, 1 + s, dt, op)
        for s in range(len(plan.counts)):
            self.node_broadcast(x[plan.span(s)], plan.node_ranks.index(plan.owners[s]), dt)

    def _leaders_all_reduce(self, x: Array, dt: DType, op: ReduceOp) -> None:
        """Reduce to local rank 0, all_reduce of those across nodes, broadcast inside; up to
        ``PAIRS_BYTES`` on nodes of equal size, an all_reduce inside the node, then every local
        rank all_reduces the node's sum with the same local rank of the other nodes (the same
        bits everywhere: every such group reduces the same values in the same order)."""
        lv = self._lv
        if lv.even and x.nbytes <= PAIRS_BYTES:
            self.node_all_reduce(x, dt, op.combine)
            self.across_all_reduce(x, lv.peers, _LEADERS, dt, op)
            return
        self.node_reduce(x, 0, dt, op.combine)
        if lv.local == 0:
            self.across_all_reduce(x, lv.leaders, _LEADERS, dt, op)
        self.node_broadcast(x, 0, dt)

    def _bridges(self, root: int) -> tuple[tuple[int, ...], int, int]:
        """For a rooted call: the ranks that carry it between nodes (the root on its node,
        local rank 0 on the others), the root's index among them, and this node's rank
        that carries it (a local rank)."""
        lv = self._lv
        root_node, root_local = lv.nodes.place(root)
        bridges = tuple(root if k == root_node else m[0] for k, m in enumerate(lv.nodes.members))
        return bridges, root_node, root_local if lv.node == root_node else 0

    def broadcast(self, x: Array, dt: DType, root: int) -> None:
        lv = self._lv
        bridges, at, here = self._bridges(root)
        if lv.me in bridges:
            tree.broadcast(self.across(bridges, _LEADERS, fingerprint("broadcast", dt, x.shape[0], root=at)), x, at)
        self.node_broadcast(x, here, dt)

    def reduce(self, x: Array, dt: DType, root: int, op: ReduceOp) -> None:
        lv = self._lv
        bridges, at, here = self._bridges(root)
        buf = x
        if lv.me != root:  # only the root's tensor changes
            buf = self._call.scratch.get(_COPY, x.shape[0], x.dtype)
            buf[...] = x
        self.node_reduce(buf, here, dt, op.combine)
        if lv.me in bridges:
            c = self.across(bridges, _LEADERS, fingerprint("reduce", dt, x.shape[0], op, at))
            tree.reduce(c, buf, at, reducer(dt, op), op.divisor(lv.world_size))
        # Every rank returns only once its node's bridge is through: a rank that only gave its
        # part would otherwise return before the other nodes were in the call, and miss a
        # failure of the call before.
        self.node_barrier()

    def all_gather(self, x: Array, dt: DType, blocks: Blocks) -> None:
        """Nodes of equal size: every local rank swaps its block with the same local rank of
        the other nodes (a stream each), then an all-gather inside the node of what each
        holds. Else: inside the node, then local ranks 0 swap their nodes' blocks, then a
        broadcast inside."""
        lv, n = self._lv, x.shape[0]
        nodes, scratch = lv.nodes.members, self._call.scratch
        if lv.even:
            count, size = len(nodes), len(lv.members)
            held = scratch.get(_REMOTE, count * n, x.dtype)  # node k's block of this local rank, by k
            held[lv.node * n : (lv.node + 1) * n] = x
            c = self.across(lv.peers, _LEADERS, fingerprint("all_gather", dt, n))
            others = [k for k in range(count) if k != lv.node]
            pending = [c.irecv(held[k * n : (k + 1) * n], k) for k in others]
            c.wait_all(pending + [c.isend(x, k) for k in others])
            everything = scratch.get(_NODE_BLOCKS, size * count * n, x.dtype)
            self.node_all_gather(held, everything, dt)
            for j in range(size):
                for k in range(count):
                    start = (j * count + k) * n
                    blocks[nodes[k][j]][...] = everything[start : start + n]
            return
        mine = scratch.get(_NODE_BLOCKS, n * len(lv.members), x.dtype)
        self.node_all_gather(x, mine, dt)
        others = [k for k in range(len(nodes)) if k != lv.node]
        starts = np.cumsum([0] + [len(nodes[k]) * n for k in others]).tolist()
        remote = scratch.get(_REMOTE, starts[-1], x.dtype)
        if lv.local == 0:
            c = self.across(lv.leaders, _LEADERS, fingerprint("all_gather", dt, n))
            pending = [c.irecv(remote[starts[i] : starts[i + 1]], k) for i, k in enumerate(others)]
            pending += [c.isend(mine, k) for k in others]
            c.wait_all(pending)
        self.node_broadcast(remote, 0, dt)
        for j, rank in enumerate(lv.members):
            blocks[rank][...] = mine[j * n : (j + 1) * n]
        for i, k in enumerate(others):
            for j, rank in enumerate(nodes[k]):
                blocks[rank][...] = remote[starts[i] + j * n : starts[i] + (j + 1) * n]

    def reduce_scatter(self, out: Array, dt: DType, blocks: Blocks, op: ReduceOp) -> None:
        """Even nodes: inside the node, local rank j gets the node's sum of the blocks of every
        node's local rank j; across, those ranks reduce-scatter them. Uneven: a two-level
        all_reduce of a copy of the input, then this rank's block."""
        lv, n = self._lv, out.shape[0]
        nodes, scratch = lv.nodes.members, self._call.scratch
        inside = op.combine
        if not lv.even:
            whole = scratch.get(_PACKED, n * len(blocks), out.dtype)
            for r, block in enumerate(blocks):
                whole[r * n : (r + 1) * n] = block
            self.all_reduce(whole, dt, op)
            out[...] = whole[lv.me * n : (lv.me + 1) * n]
            return
        count = len(nodes)
        packed = scratch.get(_PACKED, n * len(blocks), out.dtype)
        for j in range(len(lv.members)):
            for k in range(count):
                start = (j * count + k) * n
                packed[start : start + n] = blocks[nodes[k][j]]
        part = scratch.get(_SHARD, n * count, out.dtype)
        self.node_reduce_scatter(packed, part, dt, inside)
        c = self.across(lv.peers, 1 + lv.local, fingerprint("reduce_scatter", dt, n, op))
        ring.reduce_scatter(c, out, Blocks.of(part, count), reducer(dt, op), op.divisor(lv.world_size))

    def barrier(self) -> None:
        lv = self._lv
        self.node_barrier()
        if lv.local == 0:
            tree.barrier(self.across(lv.leaders, _LEADERS, fingerprint("barrier")))
        self.node_barrier()
