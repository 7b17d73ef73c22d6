"""A two-level call as a plan of steps: which ranks do what, on which part of which buffer.

Every collective the two levels run is, on each rank, a sequence of steps: inside the node
(its ranks, over the node's transport: through its shared-memory arena where it has one),
across nodes (one rank per node, over the world's transport) and copies here. A step says
its level, operation and algorithm, its ranks (global numbers), the span of the buffer it
works on, its number (which goes into the tag of its messages, so that two steps never take
each other's messages) and its fingerprint. :func:`plan_steps` decides every path here:

- all_reduce up to ``SMALL_BYTES`` (or with fewer elements than shards) goes through the
  leaders (local rank 0 of each node: a reduce inside, an all_reduce of those across, a
  broadcast inside), or, up to ``PAIRS_BYTES`` on nodes of equal size, an all_reduce inside
  the node and then every local rank's with the same local rank of the other nodes;
- a larger all_reduce on nodes of equal size goes in pieces of at most ``PIECE_BYTES``, each
  a reduce-scatter inside, an all_reduce per shard across, an all-gather inside; on nodes of
  unequal size, an all_reduce inside, one per owned shard across (``levels_plan``), and a
  broadcast of each shard from its owner inside;
- rooted calls cross between nodes through the root and local rank 0 of the other nodes;
  all_gather and reduce_scatter on equal nodes give every local rank a stream of its own.

A plan is a plain value, made once per kind of call and printed by ``FERRODIST_DEBUG=route``;
``run.Levels`` only executes it. tests/collectives/test_levels.py checks, for every shape of
nodes, that the ranks of each step agree on it and meet their shared steps in one order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ferrodist.collectives._algorithms.select import SMALL_MESSAGE_BYTES, all_reduce_algorithm
from ferrodist.collectives._fingerprint import fingerprint
from ferrodist.core import DType, ReduceOp

from .plan import Nodes, levels_plan

__all__ = [
    "LEADERS",
    "OPERATIONS",
    "PAIRS_BYTES",
    "PIECE_BYTES",
    "SMALL_BYTES",
    "Span",
    "Step",
    "StepPlan",
    "plan_steps",
]

#: The operations the two levels run (the others run flat over the world's transport).
OPERATIONS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier")
#: all_reduce up to this many bytes is not cut into shards (see the module's docstring).
SMALL_BYTES = 64 * 1024
#: ... and up to this many on nodes of equal size goes by pairs of the same local rank.
PAIRS_BYTES = 16 * 1024
#: A large all_reduce on nodes of equal size goes in pieces of at most this many bytes (each
#: its three steps), so that what a step inside the node writes is still in cache when the
#: next step reads it.
PIECE_BYTES = 4 << 20
#: The number of the one cross-node step of the leaders (and of the pairs, and the bridges).
LEADERS = 0x7FF
#: Scratch slots of the steps (the algorithms use 0..2, the transport's own collectives 7).
SHARD, COPY, NODE_BLOCKS, REMOTE, PACKED = 8, 9, 10, 11, 12


@dataclass(frozen=True, slots=True)
class Span:
    """``count`` elements of a buffer from ``start``: ``"x"`` (the call's tensor: all_gather's
    input, reduce_scatter's output), ``"block r"`` (the call's block of rank r) or
    ``"scratch k"`` (slot k of the call's scratch space)."""

    buffer: str
    start: int
    count: int

    def __str__(self) -> str:
        return f"{self.buffer}[{self.start}:{self.start + self.count}]"


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a two-level call on this rank.

    ``level``: ``"node"`` (among this node's ranks, over its transport), ``"across"`` (one
    rank per node, over the world's) or ``"here"`` (a copy on this rank). ``algorithm``:
    ``"arena"`` (the node transport's own collective), ``"ring"``, ``"recursive_doubling"``,
    ``"swap"`` (one exchange of two ranks), ``"tree"``, ``"dissemination"``, ``"exchange"``
    (every rank's ``data`` to every other, received into ``parts``) or ``"copy"``. ``ranks``
    are global; ``index`` is this rank's among them and ``root`` an index too. ``data`` is
    what the step works on (in place, or read), ``out`` where it writes when that is
    elsewhere. ``op`` and ``divisor`` reduce; ``number`` goes into the tag.
    """

    level: str
    operation: str
    algorithm: str
    ranks: tuple[int, ...]
    index: int
    data: Span | None
    out: Span | None = None
    root: int | None = None
    op: ReduceOp | None = None
    divisor: float = 1.0
    number: int = 0
    fingerprint: int = 0
    parts: tuple[Span | None, ...] = ()

    @property
    def reduce_op(self) -> ReduceOp:
        """The op of a step that reduces."""
        assert self.op is not None, f"{self}: a step that reduces has an op"
        return self.op

    @property
    def at(self) -> int:
        """The root's index of a rooted step."""
        assert self.root is not None, f"{self}: a rooted step has a root"
        return self.root

    def __str__(self) -> str:
        if self.level == "here":
            return f"copy {self.data} -> {self.out}"
        words = [f"{self.level} #{self.number:#x}" if self.level == "across" else f"node #{self.number}"]
        words.append(f"{self.operation} ({self.algorithm}) with ranks {list(self.ranks)}")
        if self.root is not None:
            words.append(f"root {self.ranks[self.root]}")
        if self.op is not None:
            words.append(self.op.name + (f" / {self.divisor:g}" if self.divisor != 1.0 else ""))
        if self.data is not None:
            words.append(f"on {self.data}")
        if self.out is not None:
            words.append(f"into {self.out}")
        return " ".join(words)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one kind of two-level call does on one rank: its steps in order, and how many
    elements each scratch slot it uses must hold."""

    operation: str
    dtype: DType | None
    rank: int
    steps: tuple[Step, ...]
    scratch: tuple[tuple[int, int], ...]

    def __str__(self) -> str:
        lines = [f"rank {self.rank}: {self.operation} over two levels in {len(self.steps)} steps:"]
        lines += [f"  {k}. {step}" for k, step in enumerate(self.steps, 1)]
        return "\n".join(lines)


def plan_steps(
    nodes: Nodes,
    rank: int,
    arena: bool,
    operation: str,
    dt: DType | None,
    count: int,
    op: ReduceOp | None = None,
    root: int | None = None,
) -> StepPlan:
    """Rank ``rank``'s steps for ``operation`` over ``nodes`` on ``count`` elements (of each
    block, for all_gather and reduce_scatter), with the node's arena (``arena``) or our
    algorithms over the node's transport."""
    maker = _Maker(nodes, rank, arena, dt)
    if operation == "all_reduce":
        assert op is not None
        maker.all_reduce(Span("x", 0, count), op)
    elif operation == "broadcast":
        assert root is not None
        maker.broadcast(count, root)
    elif operation == "reduce":
        assert root is not None and op is not None
        maker.reduce(count, root, op)
    elif operation == "all_gather":
        maker.all_gather(count)
    elif operation == "reduce_scatter":
        assert op is not None
        maker.reduce_scatter(count, op)
    elif operation == "barrier":
        maker.barrier()
    else:
        raise AssertionError(f"the two levels do not run {operation}")
    return StepPlan(operation, dt, rank, tuple(maker.steps), tuple(sorted(maker.scratch.items())))


def _scratch(slot: int, start: int, count: int) -> Span:
    return Span(f"scratch {slot}", start, count)


class _Maker:
    """Builds one rank's steps (see ``plan_steps``)."""

    def __init__(self, nodes: Nodes, rank: int, arena: bool, dt: DType | None) -> None:
        self.nodes, self.me, self.arena, self.dt = nodes, rank, arena, dt
        self.node, self.local = nodes.place(rank)
        self.members = nodes.members[self.node]
        self.leaders = tuple(m[0] for m in nodes.members)
        self.even = len({len(m) for m in nodes.members}) == 1
        self.peers = tuple(m[self.local] for m in nodes.members) if self.even else ()
        self.shards = max(len(m) for m in nodes.members)
        self.world_size = nodes.world_size
        self.itemsize = dt.itemsize if dt is not None else 1
        self.steps: list[Step] = []
        self.scratch: dict[int, int] = {}
        self.node_steps = 0

    def use(self, slot: int, count: int) -> None:
        self.scratch[slot] = max(self.scratch.get(slot, 0), count)

    # -- one step --------------------------------------------------------------------------------
    def inside(
        self,
        operation: str,
        data: Span | None,
        fp: int,
        *,
        out: Span | None = None,
        root: int | None = None,
        op: ReduceOp | None = None,
    ) -> None:
        """A step among this node's ranks (none on a node of one rank, where all_gather and
        reduce_scatter copy their ``data`` to ``out``)."""
        if len(self.members) == 1:
            if operation in ("all_gather", "reduce_scatter"):
                assert data is not None and out is not None
                self.copy(data, out)
            return
        self.node_steps += 1
        ours = "tree" if operation in ("broadcast", "reduce") else "dissemination" if operation == "barrier" else "ring"
        algorithm = "arena" if self.arena else ours
        self.steps.append(
            Step("node", operation, algorithm, self.members, self.local, data, out, root, op, 1.0, self.node_steps, fp)
        )

    def across(
        self,
        operation: str,
        algorithm: str,
        ranks: Sequence[int],
        number: int,
        data: Span | None,
        fp: int,
        *,
        out: Span | None = None,
        root: int | None = None,
        op: ReduceOp | None = None,
        divisor: float = 1.0,
        parts: tuple[Span | None, ...] = (),
    ) -> None:
        """A step among ``ranks`` (global, one per node) over the world's transport."""
        ranks = tuple(ranks)
        index = ranks.index(self.me)
        self.steps.append(
            Step("across", operation, algorithm, ranks, index, data, out, root, op, divisor, number, fp, parts)
        )

    def copy(self, data: Span, out: Span) -> None:
        self.steps.append(Step("here", "copy", "copy", (self.me,), 0, data, out))

    # -- the steps of each collective ------------------------------------------------------------
    def node_all_reduce(self, x: Span, op: ReduceOp) -> None:
        self.inside("all_reduce", x, fingerprint("all_reduce", self.dt, x.count, op), op=op)

    def across_all_reduce(self, x: Span, ranks: Sequence[int], number: int, op: ReduceOp) -> None:
        fp = fingerprint("all_reduce", self.dt, x.count, op)
        nbytes = x.count * self.itemsize
        if len(ranks) == 2 and nbytes <= SMALL_MESSAGE_BYTES:
            algorithm = "swap"
        else:
            algorithm = all_reduce_algorithm(nbytes, len(ranks), None, rank=self.me)
        self.across("all_reduce", algorithm, ranks, number, x, fp, op=op, divisor=op.divisor(self.world_size))

    def all_reduce(self, x: Span, op: ReduceOp) -> None:
        n, size = x.count, len(self.members)
        inside = op.combine
        if n * self.itemsize <= SMALL_BYTES or n < self.shards:
            self.leaders_all_reduce(x, op)
            return
        if self.even:
            step = max(1, PIECE_BYTES // self.itemsize // size) * size  # elements per piece
            main = n // size * size
            for start in range(0, main, step):
                piece = Span(x.buffer, x.start + start, min(main, start + step) - start)
                shard = _scratch(SHARD, 0, piece.count // size)
                self.use(SHARD, shard.count)
                fp = fingerprint("reduce_scatter", self.dt, shard.count, inside)
                self.inside("reduce_scatter", piece, fp, out=shard, op=inside)
                self.across_all_reduce(shard, self.peers, 1 + self.local, op)
                self.inside("all_gather", shard, fingerprint("all_gather", self.dt, shard.count), out=piece)
            if main < n:
                self.leaders_all_reduce(Span(x.buffer, x.start + main, n - main), op)
            return
        plan = levels_plan(self.nodes, n, self.me)
        self.node_all_reduce(x, inside)
        for s, group in zip(plan.owned, plan.across, strict=True):
            self.across_all_reduce(Span(x.buffer, x.start + plan.offsets[s], plan.counts[s]), group, 1 + s, op)
        for s in range(len(plan.counts)):
            shard = Span(x.buffer, x.start + plan.offsets[s], plan.counts[s])
            at = plan.node_ranks.index(plan.owners[s])
            self.inside("broadcast", shard, fingerprint("broadcast", self.dt, shard.count, root=at), root=at)

    def leaders_all_reduce(self, x: Span, op: ReduceOp) -> None:
        if self.even and x.count * self.itemsize <= PAIRS_BYTES:
            self.node_all_reduce(x, op.combine)
            self.across_all_reduce(x, self.peers, LEADERS, op)
            return
        self.inside("reduce", x, fingerprint("reduce", self.dt, x.count, op.combine, 0), root=0, op=op.combine)
        if self.local == 0:
            self.across_all_reduce(x, self.leaders, LEADERS, op)
        self.inside("broadcast", x, fingerprint("broadcast", self.dt, x.count, root=0), root=0)

    def bridges(self, root: int) -> tuple[tuple[int, ...], int, int]:
        """For a rooted call: the ranks that carry it between nodes (the root on its node,
        local rank 0 on the others), the root's index among them, and this node's rank
        that carries it (a local rank)."""
        root_node, root_local = self.nodes.place(root)
        bridges = tuple(root if k == root_node else m[0] for k, m in enumerate(self.nodes.members))
        return bridges, root_node, root_local if self.node == root_node else 0

    def broadcast(self, n: int, root: int) -> None:
        bridges, at, here = self.bridges(root)
        x = Span("x", 0, n)
        if self.me in bridges:
            self.across(
                "broadcast", "tree", bridges, LEADERS, x, fingerprint("broadcast", self.dt, n, root=at), root=at
            )
        self.inside("broadcast", x, fingerprint("broadcast", self.dt, n, root=here), root=here)

    def reduce(self, n: int, root: int, op: ReduceOp) -> None:
        bridges, at, here = self.bridges(root)
        buf = Span("x", 0, n)
        if self.me != root:  # only the root's tensor changes
            buf = _scratch(COPY, 0, n)
            self.use(COPY, n)
            self.copy(Span("x", 0, n), buf)
        self.inside("reduce", buf, fingerprint("reduce", self.dt, n, op.combine, here), root=here, op=op.combine)
        if self.me in bridges:
            fp = fingerprint("reduce", self.dt, n, op, at)
            self.across(
                "reduce", "tree", bridges, LEADERS, buf, fp, root=at, op=op, divisor=op.divisor(self.world_size)
            )
        # Every rank returns only once its node's bridge is through: a rank that only gave its
        # part would otherwise return before the other nodes were in the call, and miss a
        # failure of the call before.
        self.inside("barrier", None, fingerprint("barrier"))

    def all_gather(self, n: int) -> None:
        """Nodes of equal size: every local rank swaps its block with the same local rank of
        the other nodes (a stream each), then an all-gather inside the node of what each
        holds. Else: inside the node, then local ranks 0 swap their nodes' blocks, then a
        broadcast inside."""
        nodes = self.nodes.members
        x = Span("x", 0, n)
        if self.even:
            count, size = len(nodes), len(self.members)
            self.use(REMOTE, count * n)  # node k's block of this local rank, by k
            self.copy(x, _scratch(REMOTE, self.node * n, n))
            parts = tuple(None if k == self.node else _scratch(REMOTE, k * n, n) for k in range(count))
            self.across(
                "all_gather", "exchange", self.peers, LEADERS, x, fingerprint("all_gather", self.dt, n), parts=parts
            )
            self.use(NODE_BLOCKS, size * count * n)
            held, everything = _scratch(REMOTE, 0, count * n), _scratch(NODE_BLOCKS, 0, size * count * n)
            self.inside("all_gather", held, fingerprint("all_gather", self.dt, count * n), out=everything)
            for j in range(size):
                for k in range(count):
                    self.copy(_scratch(NODE_BLOCKS, (j * count + k) * n, n), Span(f"block {nodes[k][j]}", 0, n))
            return
        size = len(self.members)
        self.use(NODE_BLOCKS, n * size)
        mine = _scratch(NODE_BLOCKS, 0, n * size)
        self.inside("all_gather", x, fingerprint("all_gather", self.dt, n), out=mine)
        others = [k for k in range(len(nodes)) if k != self.node]
        starts = [0]
        for k in others:
            starts.append(starts[-1] + len(nodes[k]) * n)
        self.use(REMOTE, starts[-1])
        if self.local == 0:
            parts = tuple(
                None if k == self.node else _scratch(REMOTE, starts[others.index(k)], len(nodes[k]) * n)
                for k in range(len(nodes))
            )
            fp = fingerprint("all_gather", self.dt, n)
            self.across("all_gather", "exchange", self.leaders, LEADERS, mine, fp, parts=parts)
        remote = _scratch(REMOTE, 0, starts[-1])
        self.inside("broadcast", remote, fingerprint("broadcast", self.dt, starts[-1], root=0), root=0)
        for j, r in enumerate(self.members):
            self.copy(_scratch(NODE_BLOCKS, j * n, n), Span(f"block {r}", 0, n))
        for i, k in enumerate(others):
            for j, r in enumerate(nodes[k]):
                self.copy(_scratch(REMOTE, starts[i] + j * n, n), Span(f"block {r}", 0, n))

    def reduce_scatter(self, n: int, op: ReduceOp) -> None:
        """Even nodes: inside the node, local rank j gets the node's sum of the blocks of every
        node's local rank j; across, those ranks reduce-scatter them. Uneven: a two-level
        all_reduce of a copy of the input, then this rank's block."""
        nodes = self.nodes.members
        world = self.world_size
        self.use(PACKED, n * world)
        if not self.even:
            for r in range(world):
                self.copy(Span(f"block {r}", 0, n), _scratch(PACKED, r * n, n))
            self.all_reduce(_scratch(PACKED, 0, n * world), op)
            self.copy(_scratch(PACKED, self.me * n, n), Span("x", 0, n))
            return
        count = len(nodes)
        for j in range(len(self.members)):
            for k in range(count):
                self.copy(Span(f"block {nodes[k][j]}", 0, n), _scratch(PACKED, (j * count + k) * n, n))
        self.use(SHARD, n * count)
        part = _scratch(SHARD, 0, n * count)
        fp = fingerprint("reduce_scatter", self.dt, n * count, op.combine)
        self.inside("reduce_scatter", _scratch(PACKED, 0, n * world), fp, out=part, op=op.combine)
        fp = fingerprint("reduce_scatter", self.dt, n, op)
        divisor = op.divisor(world)
        self.across(
            "reduce_scatter", "ring", self.peers, 1 + self.local, part, fp, out=Span("x", 0, n), op=op, divisor=divisor
        )

    def barrier(self) -> None:
        self.inside("barrier", None, fingerprint("barrier"))
        if self.local == 0:
            self.across("barrier", "dissemination", self.leaders, LEADERS, None, fingerprint("barrier"))
        self.inside("barrier", None, fingerprint("barrier"))


def spans(plan: StepPlan) -> Iterator[Span]:
    """Every span a plan's steps read or write (for checks)."""
    for step in plan.steps:
        for span in (step.data, step.out, *step.parts):
            if span is not None:
                yield span
