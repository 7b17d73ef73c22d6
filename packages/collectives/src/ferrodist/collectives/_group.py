"""``ProcessGroup``: a set of ranks and the collectives they run together.

Ranks passed to a ``ProcessGroup`` method are *group* ranks (0 .. size-1), as on
``torch.distributed.ProcessGroup`` objects; the module-level functions take global
ranks and translate. Every argument is checked before a byte moves; every call has
a deadline; an error names the rank, the call and its sequence number.

A group is made of three parts: the ``Runner`` (ordering, call identity, deadline,
abort, blame), the ``Route`` (the plan of each kind of call, see ``_route``) and the
``Messages`` (point to point). Each collective checks its arguments, asks the route
for the plan and hands it to the runner; a call of a kind seen before finds its plan
from the arguments as given and skips the checks.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ferrodist.core import (
    CollectiveTimeout,
    DType,
    FerrodistError,
    Group,
    GroupAborted,
    GroupInfo,
    InvalidArgument,
    InvalidRank,
    ReduceOp,
    Tensor,
    device_view,
    host_view,
)
from ferrodist.transport import Transport

from ._algorithms import direct, monitored
from ._algorithms.select import all_reduce_algorithm
from ._call import subgroup_channel
from ._checks import Blocks, Checker, device_blocks, on_group, split_equally, subgroup_members, wire_dtype
from ._device import DeviceRoute, device_type, requested_route
from ._failures import agreement, blame, replacements
from ._fingerprint import fingerprint
from ._p2p import Messages
from ._route import Route
from ._rows import Rows
from ._runner import Runner
from ._timeouts import Timeout
from ._work import RequestWork, Work


class ProcessGroup:
    """Ranks that run collectives together; made by ``init_process_group`` (the world) and
    ``new_group`` (subsets).

    Example (each rank runs this)::

        world = init_process_group("simulated", transport=t)  # rank 0 and rank 1
        x = np.array([rank + 1.0])
        world.all_reduce(x)          # rank 0: [3.]   rank 1: [3.]
    """

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int],
        group_id: int,
        *,
        timeout: float,
        name: str,
        debug: bool = False,
        cuda_route: str | None = None,
        native: bool = True,
    ) -> None:
        self._transport = transport
        self._debug = debug
        self._ranks = tuple(ranks)
        self._group_id = group_id
        self._timeout = float(timeout)
        self._name = name
        self._global_rank = transport.rank
        self._rank = self._ranks.index(self._global_rank) if self._global_rank in self._ranks else None
        self._runner = Runner(
            transport, ranks, group_id, name=name, timeout=self._timeout, debug=debug, member=self.member_rank
        )
        # The transport's own collectives for these ranks (MPI's, the shm arena's), or None.
        # Every rank of the world builds every group, so this may be a collective call; a
        # group made by its members only (``subgroup``) asks for none.
        own = transport.native_collectives(self._ranks, group_id) if native else None
        devices = DeviceRoute(requested_route(cuda_route, rank=transport.rank))
        info = GroupInfo(name, -1 if self._rank is None else self._rank, len(self._ranks), self._timeout)
        self._route = Route(self._runner, own, devices, info, debug=debug)
        self._messages = Messages(transport, self._runner, self._ranks, group_id, name, self._timeout)
        self._child_ids = itertools.count(1)  # ids of the groups new_group derives from this one
        self._children: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()
        self._named: dict[int, tuple[str, ProcessGroup]] = {}  # channel -> the subgroup on it
        self._destroyed = False
        self._shrinks = 0  # attempts to shrink it

    # -- identity ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.member_rank("rank")

    @property
    def size(self) -> int:
        return len(self._ranks)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks of the members, in group-rank order."""
        return self._ranks

    @property
    def global_rank(self) -> int:
        return self._global_rank

    @property
    def is_member(self) -> bool:
        return self._rank is not None

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def name(self) -> str:
        return self._name

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def cuda_route(self) -> str | None:
        """The engine this group's CUDA tensors go through (``"nccl"`` or ``"staged"``), or
        None before its first collective on CUDA tensors chose it."""
        choice = self._route.devices.choice
        return None if choice is None else choice.engine

    def group_rank(self, global_rank: int) -> int:
        """The group rank of a global rank (``InvalidRank`` if it is not a member)."""
        try:
            return self._ranks.index(int(global_rank))
        except (ValueError, TypeError):
            raise InvalidRank(
                f"rank {self._global_rank}: global rank {global_rank!r} is not in group {self._name} "
                f"(members: {list(self._ranks)})",
                rank=self._global_rank,
            ) from None

    def member_rank(self, operation: str) -> int:
        """This rank's group rank; ``InvalidRank`` naming ``operation`` when this rank is not
        a member, ``InvalidArgument`` when the group was destroyed."""
        if self._destroyed:
            raise InvalidArgument(
                f"rank {self._global_rank}: {operation} on group {self._name}, which was destroyed",
                rank=self._global_rank,
                operation=operation,
            )
        if self._rank is None:
            raise InvalidRank(
                f"rank {self._global_rank}: {operation}: this rank is not a member of group {self._name} "
                f"(members: {list(self._ranks)}); only members may use it",
                rank=self._global_rank,
                operation=operation,
            )
        return self._rank

    def __repr__(self) -> str:
        me = f"rank={self._rank}" if self.is_member else "not a member"
        return f"<ProcessGroup {self._name} ranks={list(self._ranks)} {me}>"

    def _derive(self, ranks: Sequence[int], timeout: float | None, cuda_route: str | None = None) -> ProcessGroup:
        """A group of some of this group's ranks (global ranks), shut down along with this one."""
        child = self._made(ranks, f"{(i := next(self._child_ids))}{list(ranks)}", i, timeout, cuda_route, native=True)
        self._children.add(child)
        return child

    def _made(
        self,
        ranks: Sequence[int],
        name: str,
        group_id: int | None = None,
        timeout: float | None = None,
        route: str | None = None,
        native: bool = False,
    ) -> ProcessGroup:
        """A group over this one's transport, with its options unless given (on the channel of
        ``name``, like ``subgroup``'s, unless ``group_id`` is)."""
        group_id = subgroup_channel(name) if group_id is None else group_id
        timeout, route = self._timeout if timeout is None else timeout, route or self._route.devices.requested
        t, d = self._transport, self._debug
        return ProcessGroup(t, ranks, group_id, timeout=timeout, name=name, debug=d, cuda_route=route, native=native)

    def subgroup(self, ranks: Sequence[int], *, name: str, timeout: float | None = None) -> ProcessGroup:
        """A group of some of this group's ranks (global ranks) over the same transport, made
        by its members only, as torch makes a backend's groups: no socket, arena or rendezvous
        of its own, but its own call numbering, scratch and worker, on a channel derived from
        ``name`` (which every member passes alike). It runs our algorithms (a transport's own
        collectives are made by every rank of the world at once). Shut down with this group."""
        members = subgroup_members(ranks, self._ranks, self._global_rank, name, self._name)
        channel = subgroup_channel(name)
        taken = self._named.get(channel)
        if taken is not None and taken[0] != name and not taken[1]._destroyed:
            raise InvalidArgument(
                f"rank {self._global_rank}: subgroup {name}: its channel is taken by subgroup {taken[0]}; "
                "give it another name",
                rank=self._global_rank,
                operation="subgroup",
            )
        child = self._made(members, name, channel, timeout)
        self._named[channel] = (name, child)
        self._children.add(child)
        return child

    # -- check and plan -------------------------------------------------------------------------
    def _checker(self, operation: str) -> Checker:
        return on_group(self, operation)

    def _engine(self, operation: str, tensors: Sequence[Tensor], dt: DType, op: ReduceOp | None = None) -> Any:
        """The device engine for a call on CUDA tensors, or None for host tensors."""
        if device_type(self._global_rank, operation, tensors) is None:
            return None
        return self._route.engine(dt, op)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(
        self,
        tensor: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
        algorithm: str | None = None,
        compress: str | None = None,
    ) -> Work | None:
        """Reduce ``tensor`` across the group, in place on every rank.

        ``algorithm``: ``"auto"`` (the transport's own all_reduce where it takes the call, else two levels
        across nodes, else recursive doubling up to 64 KiB and a ring above), ``"ring"`` or
        ``"recursive_doubling"``. Every rank ends with identical bits. ``compress="bf16"`` (float32
        tensors): round to bfloat16, all_reduce those (float32 accumulation per step), widen
        back: half the bytes move, at bfloat16 precision; to the bit, the all_reduce of the
        rounded tensor. CUDA tensors are rounded on the device; over shared memory, inside
        the loop that moves the data.

        Example::

            x = np.array([rank + 1, 10 * (rank + 1)])   # rank 0: [1, 10]  rank 1: [2, 20]
            group.all_reduce(x, ReduceOp.MAX)            # rank 0: [2, 20]  rank 1: [2, 20]
        """
        signature: Hashable = None  # the arguments as given, under which a checked call's plan is kept
        x = host_view(tensor)
        if x is not None:
            signature = ("all_reduce", x.dtype, x.size, op, algorithm, compress)
            if x.flags.writeable and (plan := self._route.known(signature)) is not None:
                return self._runner.run(plan, (x if x.ndim == 1 else x.reshape(-1),), async_op, timeout)
        elif (d := device_view(tensor)) is not None:  # a CUDA tensor, known by its address
            signature = ("all_reduce", "cuda", d.device.index, d.dtype, d.numel, op, algorithm, compress)
            if (plan := self._route.known(signature)) is not None:
                return self._runner.run(plan, (d,), async_op, timeout, d.shape)
        check = self._checker("all_reduce")
        t = check.tensor(tensor, writeable=True)
        reduce_op = check.op(op, t)
        all_reduce_algorithm(t.nbytes, self.size, algorithm, rank=self._global_rank)  # a known name
        engine = self._engine("all_reduce", [t], t.dtype, reduce_op)
        wire = wire_dtype(check, compress, t)
        plan = self._route.plan(
            "all_reduce",
            t.dtype,
            t.numel,
            op=reduce_op,
            algorithm=algorithm,
            engine=engine,
            wire=wire,
            signature=signature,
        )
        return self._runner.run(plan, (t if engine else t.flat(),), async_op, timeout, t.shape)

    def broadcast(self, tensor: Any, src: int = 0, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Copy group rank ``src``'s ``tensor`` into every rank's ``tensor`` (binomial tree).

        Example::

            x = np.array([rank, rank])     # rank 0: [0, 0]  rank 1: [1, 1]
            group.broadcast(x, src=1)      # rank 0: [1, 1]  rank 1: [1, 1]
        """
        x = host_view(tensor)
        signature = None if x is None else ("broadcast", x.dtype, x.size, src)
        if x is not None and (plan := self._route.known(signature)) is not None:
            if x.flags.writeable or plan.root == self._rank:
                return self._runner.run(plan, (x if x.ndim == 1 else x.reshape(-1),), async_op, timeout)
        check = self._checker("broadcast")
        root = check.root(src, self.size, "src")
        t = check.tensor(tensor, writeable=self._rank != root)
        engine = self._engine("broadcast", [t], t.dtype)
        plan = self._route.plan("broadcast", t.dtype, t.numel, root=root, engine=engine, signature=signature)
        return self._runner.run(plan, (t if engine else t.flat(),), async_op, timeout, t.shape)

    def reduce(
        self,
        tensor: Any,
        dst: int = 0,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Reduce ``tensor`` across the group into group rank ``dst``'s ``tensor``.
        Other ranks' tensors are left unchanged.

        Example::

            x = np.array([rank + 1])       # rank 0: [1]  rank 1: [2]
            group.reduce(x, dst=0)         # rank 0: [3]  rank 1: [2]
        """
        check = self._checker("reduce")
        root = check.root(dst, self.size, "dst")
        t = check.tensor(tensor, writeable=self._rank == root)
        reduce_op = check.op(op, t)
        engine = self._engine("reduce", [t], t.dtype, reduce_op)
        plan = self._route.plan("reduce", t.dtype, t.numel, op=reduce_op, root=root, engine=engine)
        return self._runner.run(plan, (t if engine else t.flat(),), async_op, timeout, t.shape)

    def all_gather(self, output: Any, tensor: Any, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Every rank receives every rank's ``tensor``: ``output`` is a list of ``size`` tensors
        shaped like ``tensor``, or one tensor of ``size * tensor.numel`` elements (rank-major).

        Example::

            out = [np.empty(1), np.empty(1)]
            group.all_gather(out, np.array([rank * 1.0]))   # every rank: [[0.], [1.]]
        """
        x, out = host_view(tensor), host_view(output)
        signature = None if x is None or out is None else ("all_gather", x.dtype, x.size, out.dtype, out.size)
        if x is not None and out is not None and out.flags.writeable and (plan := self._route.known(signature)):
            return self._runner.run(plan, (x.reshape(-1), Blocks.of(out.reshape(-1), self.size)), async_op, timeout)
        check = self._checker("all_gather")
        t = check.tensor(tensor)
        blocks = check.blocks(output, t, self.size, "output", writeable=True)
        engine = self._engine("all_gather", [t, *check.seen], t.dtype)
        plan = self._route.plan("all_gather", t.dtype, t.numel, engine=engine, signature=signature)
        arrays = (t, device_blocks(blocks, t.dtype)) if engine else (t.flat(), blocks)
        return self._runner.run(plan, arrays, async_op, timeout, t.shape)

    def reduce_scatter(
        self,
        output: Any,
        input: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Group rank i's ``output`` = reduction over ranks of their i-th input block. ``input``
        is a list of ``size`` tensors shaped like ``output``, or one tensor of
        ``size * output.numel`` elements. Inputs are not modified.

        Example::

            out = np.empty(1)
            group.reduce_scatter(out, np.array([1.0, 2.0]))   # rank 0: [2.]  rank 1: [4.]
        """
        out, inp = host_view(output), host_view(input)
        signature = (
            None if out is None or inp is None else ("reduce_scatter", out.dtype, out.size, inp.dtype, inp.size, op)
        )
        if out is not None and inp is not None and out.flags.writeable and (plan := self._route.known(signature)):
            return self._runner.run(plan, (out.reshape(-1), Blocks.of(inp.reshape(-1), self.size)), async_op, timeout)
        check = self._checker("reduce_scatter")
        t = check.tensor(output, "output", writeable=True)
        blocks = check.blocks(input, t, self.size, "input", writeable=False)
        reduce_op = check.op(op, t)
        engine = self._engine("reduce_scatter", [t, *check.seen], t.dtype, reduce_op)
        plan = self._route.plan("reduce_scatter", t.dtype, t.numel, op=reduce_op, engine=engine, signature=signature)
        arrays = (t, device_blocks(blocks, t.dtype)) if engine else (t.flat(), blocks)
        return self._runner.run(plan, arrays, async_op, timeout, t.shape)

    def gather(
        self,
        tensor: Any,
        gather_list: Any = None,
        dst: int = 0,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Group rank ``dst`` receives every rank's ``tensor`` into ``gather_list`` (a list of
        ``size`` tensors, or one tensor of ``size * tensor.numel`` elements); other ranks
        pass ``gather_list=None``.

        Example::

            out = [np.empty(1), np.empty(1)] if rank == 0 else None
            group.gather(np.array([rank * 1.0]), out, dst=0)   # rank 0: out == [[0.], [1.]]
        """
        check = self._checker("gather")
        root = check.root(dst, self.size, "dst")
        t = check.tensor(tensor)
        return self._rooted(check, t, root, gather_list, "dst", fill=True, async_op=async_op, timeout=timeout)

    def scatter(
        self,
        tensor: Any,
        scatter_list: Any = None,
        src: int = 0,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Group rank ``src`` sends block i of ``scatter_list`` to rank i's ``tensor``; other
        ranks pass ``scatter_list=None``.

        Example::

            parts = [np.array([10.0]), np.array([20.0])] if rank == 0 else None
            x = np.empty(1)
            group.scatter(x, parts, src=0)      # rank 0: [10.]  rank 1: [20.]
        """
        check = self._checker("scatter")
        root = check.root(src, self.size, "src")
        t = check.tensor(tensor, writeable=True)
        return self._rooted(check, t, root, scatter_list, "src", fill=False, async_op=async_op, timeout=timeout)

    def _rooted(
        self,
        check: Checker,
        t: Tensor,
        root: int,
        listed: Any,
        root_name: str,
        *,
        fill: bool,
        async_op: bool,
        timeout: Timeout,
    ) -> Work | None:
        """gather (``fill``: the root's blocks are written) and scatter: the root's blocks
        from ``listed`` (None elsewhere, where it must be None), then the plan and the run."""
        what = f"{check.operation}_list"
        blocks = None
        if self._rank == root:
            blocks = check.blocks(check.present(listed, what), t, self.size, what, writeable=fill)
        else:
            check.absent(listed, what, root_name, root)
        engine = self._engine(check.operation, [t, *check.seen], t.dtype)
        plan = self._route.plan(check.operation, t.dtype, t.numel, root=root, engine=engine)
        if engine is None:
            return self._runner.run(plan, (t.flat(), blocks), async_op, timeout, t.shape)
        tensors = None if blocks is None else device_blocks(blocks, t.dtype)
        return self._runner.run(plan, (t, tensors), async_op, timeout, t.shape)

    def all_to_all(self, outputs: Any, inputs: Any, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Rank i's ``inputs[j]`` arrives in rank j's ``outputs[i]``. ``outputs`` and ``inputs``
        are lists of ``size`` tensors (sizes may differ per pair, but ``outputs[i]`` on rank j
        must match ``inputs[j]`` on rank i) or single tensors split into ``size`` equal blocks.

        Example::

            out = [np.empty(1), np.empty(1)]
            ins = [np.array([10.0 * rank]), np.array([10.0 * rank + 1])]
            group.all_to_all(out, ins)      # rank 0: [[0.], [10.]]  rank 1: [[1.], [11.]]
        """
        check = self._checker("all_to_all")
        outs = split_equally(check, outputs, self.size, "outputs", writeable=True)
        ins = split_equally(check, inputs, self.size, "inputs", writeable=False)
        for i, (o, t) in enumerate(zip(outs, ins, strict=False)):
            if o.dtype is not ins[0].dtype or t.dtype is not ins[0].dtype:
                raise check.fail(f"outputs[{i}] / inputs[{i}] mix dtypes; use {ins[0].dtype.name} throughout")
        me = self.member_rank("all_to_all")
        check.same_kind(ins[me], outs[me], f"inputs[{me}] (kept by this rank)")
        engine = self._engine("all_to_all", [*outs, *ins], ins[0].dtype)
        plan = self._route.plan("all_to_all", ins[0].dtype, 0, engine=engine)
        if engine is None:
            outs, ins = [o.flat() for o in outs], [t.flat() for t in ins]
        return self._runner.run(plan, (outs, ins), async_op, timeout)

    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Split ``input`` along dim 0 into ``input_split_sizes[j]`` rows for group rank j, and
        fill ``output`` with ``output_split_sizes[i]`` rows from each group rank i, in rank
        order. A split left as None means equal blocks. Rank i's ``input_split_sizes[j]``
        must equal rank j's ``output_split_sizes[i]``; where it does not, both ranks raise
        ``CollectiveMismatch`` naming the other before any row moves (the others raise too).

        Example (2 ranks)::

            x = np.arange(3.0) + 10 * rank          # rank 0: [0, 1, 2]     rank 1: [10, 11, 12]
            ins = [1, 2] if rank == 0 else [2, 1]   # rows for rank 0, rows for rank 1
            outs = [1, 2] if rank == 0 else [2, 1]  # rows from rank 0, rows from rank 1
            out = np.empty(3)
            group.all_to_all_single(out, x, outs, ins)   # rank 0: [0, 10, 11]  rank 1: [1, 2, 12]
        """
        check = self._checker("all_to_all_single")
        rows = Rows(check, output, input, output_split_sizes, input_split_sizes, self._ranks, self.rank)
        engine = self._engine("all_to_all_single", [rows.output, rows.input], rows.input.dtype)
        outs, ins = rows.blocks(device=engine is not None)
        move = direct.all_to_all if engine is None else engine.all_to_all

        def body(call: Any) -> None:
            rows.agree(call)
            move(call, outs, ins)

        fp = fingerprint("all_to_all_single", rows.input.dtype, direct=engine is not None and engine.direct)
        return self._runner.launch("all_to_all_single", body, fp, async_op=async_op, timeout=timeout)

    def barrier(self, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Return once every rank of the group has entered ``barrier`` (dissemination rounds)."""
        plan = self._route.known(("barrier",))
        if plan is None:
            self.member_rank("barrier")
            plan = self._route.plan("barrier", None, 0, signature=("barrier",))
        return self._runner.run(plan, (), async_op, timeout)

    def monitored_barrier(self, *, timeout: Timeout = None, wait_all_ranks: bool = False) -> None:
        """Return once every rank of the group has entered; otherwise raise on every rank,
        within ``timeout`` (seconds or a ``timedelta``; default the group's) plus a second,
        with group rank 0 naming the ranks that did not arrive (rank 2 of 3 missing: rank 0
        raises ``CollectiveTimeout: ... rank 2 did not arrive within 5 s``, rank 1 that rank
        0 aborted the group)."""
        check = self._checker("monitored_barrier")
        if not isinstance(wait_all_ranks, bool):
            raise check.fail(f"wait_all_ranks must be True or False, not {wait_all_ranks!r}")
        limit = self._runner.limit(timeout, "monitored_barrier")
        body = monitored.body(self._ranks, limit, wait_all_ranks)
        self._runner.launch("monitored_barrier", body, fingerprint("monitored_barrier"), async_op=False, timeout=limit)

    # -- point to point -------------------------------------------------------------------------
    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to group rank ``dst``; don't modify it until ``wait()`` returns."""
        return self._messages.start("isend", self._checker("isend"), tensor, dst, tag)

    def irecv(self, tensor: Any, src: int | None, tag: int = 0) -> RequestWork:
        """Start receiving into ``tensor`` from group rank ``src`` (None: from any rank; see ``recv``)."""
        return self._messages.start("irecv", self._checker("irecv"), tensor, src, tag)

    def send(self, tensor: Any, dst: int, tag: int = 0, *, timeout: Timeout = None) -> None:
        """Send ``tensor`` to group rank ``dst`` (matched by a ``recv`` there with the same tag)."""
        self._messages.start("send", self._checker("send"), tensor, dst, tag, timeout).wait()

    def recv(self, tensor: Any, src: int | None, tag: int = 0, *, timeout: Timeout = None) -> int:
        """Receive into ``tensor`` from group rank ``src``; returns it (see ``Messages.receive``)."""
        return self._messages.receive(self._checker("recv"), tensor, src, tag, timeout)

    # -- failure and lifetime -------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        """Fail this group on every member because of ``error`` (raised by code that drives
        the group, e.g. a pipeline stage): pending and later calls and messages here and on
        the other members raise at once (``GroupAborted``, or the error itself where a message
        was pending). Make the group again, or shrink it, to go on. A timeout waiting for one
        peer's message is followed to the rank that held them all up (``name_the_holdup``)."""
        if isinstance(error, GroupAborted):
            return
        if not isinstance(error, FerrodistError):
            error = FerrodistError(f"rank {self._global_rank}: {type(error).__name__}: {error}", rank=self._global_rank)
        self._runner.abort(error)
        if isinstance(error, CollectiveTimeout):
            blame.name_the_holdup(self._transport, self._group_id, self._global_rank, error)

    def shrink(
        self, *, exclude: Sequence[int] = (), timeout: Timeout = None, window: float | None = None
    ) -> ProcessGroup:
        """The live members as a new group over the same transport, renumbered in order (rank 2
        of 4 killed: ranks 0, 1, 3 -> 0, 1, 2): the survivors of a failure call it (see
        ``_failures.agreement``), and each gets the same members; a live rank left out raises
        ``Excluded``. ``exclude``: group ranks that take no part (every other must); ``timeout``:
        the deadline (default the group's); ``window``: how long each round waits for a member."""
        self._shrinks += 1
        limit, me = self._runner.limit(timeout, "shrink"), self.member_rank("shrink")
        members = agreement.live_members(self, me, exclude, limit, window, self._shrinks)
        return self._made(members, f"{self._name}/{'.'.join(map(str, members))}")

    def grow(self, joiners: Mapping[int, str], *, timeout: Timeout = None) -> ProcessGroup:
        """This group and the replacements of lost ranks ``joiners`` (rank -> the address each
        listens at; the same on every member) as a new group (see ``_failures.replacements``)."""
        limit = self._runner.limit(timeout, "grow")
        return self._made(*replacements.admitted(self._transport, self._ranks, self._name, joiners, limit))

    def _shutdown(self, timeout: float = 5.0) -> None:
        """Finish queued async work and stop the worker (and those of the groups derived
        from this one); the group cannot be used afterwards."""
        for child in list(self._children):
            child._shutdown(timeout)
        self._destroyed = True
        self._runner.stop(timeout)
        self._route.close()


if TYPE_CHECKING:  # ProcessGroup satisfies core's Group protocol (checked by mypy)
    _protocol_check: type[Group] = ProcessGroup
