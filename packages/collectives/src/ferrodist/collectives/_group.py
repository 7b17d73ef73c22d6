"""``ProcessGroup``: a set of ranks and the collectives they run together.

Ranks passed to a ``ProcessGroup`` method are *group* ranks (0 .. size-1), as on
``torch.distributed.ProcessGroup`` objects; the module-level functions take global
ranks and translate. Every argument is checked before a byte moves; every call has
a deadline; an error names the rank, the call and its sequence number.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrodist.core import (
    Group,
    InvalidArgument,
    InvalidRank,
    ReduceOp,
    Tensor,
    reducer,
    uint8,
)
from ferrodist.transport import DeviceEngine, GroupInfo, Transport

from . import _direct, _doubling, _native, _ring, _tree
from ._call import Call
from ._checks import Checker, device_blocks, split_equally, wire_dtype
from ._device import RECORD_BYTES, DeviceRoute, device_type, requested_route
from ._fingerprint import fingerprint
from ._host import BoundHost, HostCollectives
from ._monitor import MonitoredBarrier
from ._objects import ObjectCollectives
from ._p2p import PointToPoint
from ._runner import Runner
from ._select import all_reduce_algorithm
from ._tensors import TensorCollectives
from ._timeouts import Timeout
from ._work import Work


class ProcessGroup(PointToPoint, ObjectCollectives, TensorCollectives, MonitoredBarrier):
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
    ) -> None:
        self._transport = transport
        self._debug = debug
        # The transport's own collectives for these ranks (MPI's, the shm arena's), or None.
        # Every rank of the world builds every group, so this may be a collective call.
        self._native: Any = transport.native_collectives(tuple(ranks), group_id)
        # The same CPU route, for device engines that stage through host memory.
        self._host = HostCollectives(self._native)
        self._ranks = tuple(ranks)
        self._group_id = group_id
        self._timeout = float(timeout)
        self._name = name
        self._global_rank = transport.rank
        self._rank = self._ranks.index(self._global_rank) if self._global_rank in self._ranks else None
        self._runner = Runner(
            transport, ranks, group_id, name=name, timeout=self._timeout, debug=debug, member=self._member_rank
        )
        self._child_ids = itertools.count(1)  # ids of the groups new_group derives from this one
        self._children: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()
        # (operation, numpy dtypes, element counts, op or root as given) -> what the checks
        # worked out for calls on plain numpy arrays already validated once (DType, op or
        # root, fingerprint): later calls of the same kind go straight to the transport.
        self._fast_plans: dict[tuple[Any, ...], tuple[Any, Any, int]] = {}
        self._destroyed = False
        # The engine for CUDA tensors: chosen in the group's first call on them.
        self._devices = DeviceRoute(requested_route(cuda_route, rank=transport.rank))

    # -- identity ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._member_rank("rank")

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

    def __repr__(self) -> str:
        me = f"rank={self._rank}" if self.is_member else "not a member"
        return f"<ProcessGroup {self._name} ranks={list(self._ranks)} {me}>"

    def _member_rank(self, operation: str) -> int:
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

    def _derive(self, ranks: Sequence[int], timeout: float | None, cuda_route: str | None = None) -> ProcessGroup:
        """A group of some of this group's ranks (global ranks), shut down along with this one."""
        group_id = next(self._child_ids)
        child = ProcessGroup(
            self._transport,
            ranks,
            group_id,
            timeout=self._timeout if timeout is None else timeout,
            name=f"{group_id}{list(ranks)}",
            debug=self._debug,
            cuda_route=self._devices.requested if cuda_route is None else cuda_route,
        )
        self._children.add(child)
        return child

    # -- running a call ------------------------------------------------------------------------
    def _fast_native(self, native: Any, timeout: Timeout, async_op: bool) -> bool:
        """Whether this call may take the fast path (the transport's own collectives, no options)."""
        return native is not None and timeout is None and not (async_op or self._debug)

    def _remember(self, key: tuple[Any, ...], plan: tuple[Any, Any, int], *arrays: Any) -> None:
        """Keep ``plan`` for ``key`` when every array of the call is a plain numpy array."""
        if self._debug or not all(type(a) is np.ndarray for a in arrays):
            return
        if len(self._fast_plans) > 1024:
            self._fast_plans.clear()
        self._fast_plans[key] = plan

    def _route(
        self,
        operation: str,
        tensors: Sequence[Tensor],
        op: ReduceOp | None = None,
        algorithm: str | None = None,
        nbytes: int = 0,
    ) -> tuple[DeviceEngine | None, Any]:
        """Where a call runs: ``(the group's device engine, None)`` for CUDA tensors (chosen
        in the group's first call on them, see ``_device``); else ``(None, the transport's
        own collectives)`` where they can do this call (dtype, op; all_reduce up to their
        size limit) and the caller named none of our algorithms; else ``(None, None)``: our
        algorithms over the transport."""
        if device_type(self._global_rank, operation, tensors) is not None:
            return self._devices.for_call(self._device_engine(), tensors[0].dtype, op), None
        native = self._native
        if native is None or algorithm not in (None, "auto"):
            return None, None
        if not native.supports(tensors[0].dtype, op) or nbytes > native.all_reduce_up_to:
            return None, None
        return None, native

    def _device_engine(self) -> DeviceEngine:
        """The group's engine for CUDA tensors; the first time, the route is chosen in a
        call of its own (``cuda_route``) that every rank runs at this point."""
        devices = self._devices
        engine = devices.engine
        if engine is not None:
            return engine
        with devices.lock:
            if devices.engine is None:
                rank = self._member_rank("cuda_route")
                info = GroupInfo(self._name, rank, self.size, self._timeout)
                fp = fingerprint("cuda_route", uint8, RECORD_BYTES)
                self._runner.launch(
                    "cuda_route", lambda call: devices.setup(call, info), fp, async_op=False, timeout=None
                )
            assert devices.engine is not None  # setup raised otherwise
            return devices.engine

    @property
    def cuda_route(self) -> str | None:
        """The engine this group's CUDA tensors go through (``"nccl"`` or ``"staged"``), or
        None before its first collective on CUDA tensors chose it."""
        choice = self._devices.choice
        return None if choice is None else choice.engine

    def _checker(self, operation: str) -> Checker:
        self._member_rank(operation)
        return Checker(self._global_rank, operation)

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

        ``algorithm``: ``"auto"`` (default: recursive doubling up to 64 KiB, ring above),
        ``"ring"`` or ``"recursive_doubling"``. Every rank ends with identical bits.
        ``compress="bf16"`` (float32 CUDA tensors): convert to bfloat16 on the device, reduce
        those (float32 accumulation per step), convert back; half the bytes cross PCIe and
        the network, at bfloat16 precision.

        Example::

            x = np.array([rank + 1, 10 * (rank + 1)])   # rank 0: [1, 10]  rank 1: [2, 20]
            group.all_reduce(x, ReduceOp.MAX)            # rank 0: [2, 20]  rank 1: [2, 20]
        """
        native = self._native
        if type(tensor) is np.ndarray and timeout is None and not (async_op or algorithm or compress or self._debug):
            plan = self._fast_plans.get(("all_reduce", tensor.dtype, op, tensor.size))
            if plan is not None and tensor.flags.c_contiguous and tensor.flags.writeable:
                dt, how, fp = plan
                if dt is None:  # one of our algorithms: (engine, kernel, divisor)
                    engine, kernel, divisor = how
                    self._runner.fast_call(
                        "all_reduce", fp, lambda call: engine(call, tensor.reshape(-1), kernel, divisor)
                    )
                else:
                    self._runner.fast(
                        "all_reduce",
                        lambda deadline, seq: native.all_reduce(tensor.reshape(-1), dt, how, deadline, fp, seq),
                    )
                return None
        check = self._checker("all_reduce")
        t = check.tensor(tensor, writeable=True)
        reduce_op = check.op(op, t)
        name = all_reduce_algorithm(t.nbytes, self.size, algorithm, rank=self._global_rank)
        divisor = float(self.size) if reduce_op is ReduceOp.AVG else 1.0
        x = t.flat()
        dev, native = self._route("all_reduce", [t], reduce_op, algorithm, t.nbytes)
        wire = wire_dtype(check, compress, t, dev)
        fp = fingerprint("all_reduce", wire, t.numel, reduce_op, direct=dev is not None and dev.direct)
        if dev is not None:
            host = self._host
            return self._runner.launch(
                "all_reduce",
                lambda call: dev.all_reduce(call, BoundHost(host, call), t, reduce_op, wire),
                fp,
                async_op=async_op,
                timeout=timeout,
                shape=t.shape,
                route=dev.name,
            )
        engine = _ring.all_reduce if name == "ring" else _doubling.all_reduce
        kernel = reducer(t.dtype, reduce_op)
        if type(tensor) is np.ndarray and not (algorithm or compress):
            self._remember(
                ("all_reduce", tensor.dtype, op, t.numel),
                (t.dtype, reduce_op, fp) if native is not None else (None, (engine, kernel, divisor), fp),
                tensor,
            )
        return self._runner.launch(
            "all_reduce",
            (lambda call: native.all_reduce(x, t.dtype, reduce_op, call.deadline, call.fingerprint, call.seq))
            if native
            else (lambda call: engine(call, x, kernel, divisor)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
            route="transport" if native else name,
        )

    def broadcast(self, tensor: Any, src: int = 0, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Copy group rank ``src``'s ``tensor`` into every rank's ``tensor`` (binomial tree).

        Example::

            x = np.array([rank, rank])     # rank 0: [0, 0]  rank 1: [1, 1]
            group.broadcast(x, src=1)      # rank 0: [1, 1]  rank 1: [1, 1]
        """
        native = self._native
        if type(tensor) is np.ndarray and self._fast_native(native, timeout, async_op):
            plan = self._fast_plans.get(("broadcast", tensor.dtype, tensor.size, src))
            if plan is not None and tensor.flags.c_contiguous and (tensor.flags.writeable or plan[1] == self._rank):
                dt, root, fp = plan
                self._runner.fast(
                    "broadcast",
                    lambda deadline, seq: native.broadcast(tensor.reshape(-1), root, dt, deadline, fp, seq),
                )
                return None
        check = self._checker("broadcast")
        root = check.root(src, self.size, "src")
        t = check.tensor(tensor, writeable=self._rank != root)
        x = t.flat()
        dev, native = self._route("broadcast", [t])
        fp = fingerprint("broadcast", t.dtype, t.numel, root=root, direct=dev is not None and dev.direct)
        if native is not None and type(tensor) is np.ndarray:
            self._remember(("broadcast", tensor.dtype, t.numel, src), (t.dtype, root, fp), tensor)
        host = self._host
        return self._runner.launch(
            "broadcast",
            (lambda call: dev.broadcast(call, BoundHost(host, call), t, root))
            if dev
            else (lambda call: native.broadcast(x, root, t.dtype, call.deadline, call.fingerprint, call.seq))
            if native
            else (lambda call: _tree.broadcast(call, x, root)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
            route=_route_name(dev, native, "tree"),
        )

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
        kernel = reducer(t.dtype, reduce_op)
        divisor = float(self.size) if reduce_op is ReduceOp.AVG else 1.0
        x = t.flat()
        dev, native = self._route("reduce", [t], reduce_op)
        fp = fingerprint("reduce", t.dtype, t.numel, reduce_op, root, direct=dev is not None and dev.direct)
        host = self._host
        return self._runner.launch(
            "reduce",
            (lambda call: dev.reduce(call, BoundHost(host, call), t, root, reduce_op))
            if dev
            else (lambda call: native.reduce(x, root, t.dtype, reduce_op, call.deadline, call.fingerprint, call.seq))
            if native
            else (lambda call: _tree.reduce(call, x, root, kernel, divisor)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
            route=_route_name(dev, native, "tree"),
        )

    def all_gather(self, output: Any, tensor: Any, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Every rank receives every rank's ``tensor``: ``output`` is a list of ``size`` tensors
        shaped like ``tensor``, or one tensor of ``size * tensor.numel`` elements (rank-major).

        Example::

            out = [np.empty(1), np.empty(1)]
            group.all_gather(out, np.array([rank * 1.0]))   # every rank: [[0.], [1.]]
        """
        native = self._native
        if type(tensor) is np.ndarray and type(output) is np.ndarray and self._fast_native(native, timeout, async_op):
            plan = self._fast_plans.get(("all_gather", tensor.dtype, tensor.size, output.dtype, output.size))
            if plan is not None and tensor.flags.c_contiguous and output.flags.c_contiguous and output.flags.writeable:
                dt, _, fp = plan
                self._runner.fast(
                    "all_gather",
                    lambda deadline, seq: native.all_gather(
                        tensor.reshape(-1), output.reshape(-1), dt, deadline, fp, seq
                    ),
                )
                return None
        check = self._checker("all_gather")
        t = check.tensor(tensor)
        blocks = check.blocks(output, t, self.size, "output", writeable=True)
        x = t.flat()
        dev, native = self._route("all_gather", [t, *check.seen])
        if native is not None and type(tensor) is np.ndarray and type(output) is np.ndarray:
            key = ("all_gather", tensor.dtype, t.numel, output.dtype, output.size)
            self._remember(key, (t.dtype, None, fingerprint("all_gather", t.dtype, t.numel)), tensor, output)

        tensors = device_blocks(blocks, t.dtype) if dev else []
        host = self._host

        def body(call: Call) -> None:
            if dev:
                dev.all_gather(call, BoundHost(host, call), t, tensors)
                return
            if native:
                _native.all_gather(native, call, x, blocks, t.dtype)
                return
            blocks[call.rank][...] = x
            _ring.all_gather(call, blocks)

        fp = fingerprint("all_gather", t.dtype, t.numel, direct=dev is not None and dev.direct)
        route = _route_name(dev, native, "ring")
        return self._runner.launch(
            "all_gather", body, fp, async_op=async_op, timeout=timeout, shape=t.shape, route=route
        )

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
        native = self._native
        if type(output) is np.ndarray and type(input) is np.ndarray and self._fast_native(native, timeout, async_op):
            plan = self._fast_plans.get(("reduce_scatter", output.dtype, output.size, input.dtype, input.size, op))
            if plan is not None and output.flags.c_contiguous and output.flags.writeable and input.flags.c_contiguous:
                dt, reduce_op, fp = plan
                self._runner.fast(
                    "reduce_scatter",
                    lambda deadline, seq: native.reduce_scatter(
                        input.reshape(-1), output.reshape(-1), dt, reduce_op, deadline, fp, seq
                    ),
                )
                return None
        check = self._checker("reduce_scatter")
        out_t = check.tensor(output, "output", writeable=True)
        blocks = check.blocks(input, out_t, self.size, "input", writeable=False)
        reduce_op = check.op(op, out_t)
        kernel = reducer(out_t.dtype, reduce_op)
        divisor = float(self.size) if reduce_op is ReduceOp.AVG else 1.0
        out = out_t.flat()
        dev, native = self._route("reduce_scatter", [out_t, *check.seen], reduce_op)
        if native is not None and self.size > 1 and type(output) is np.ndarray and type(input) is np.ndarray:
            key = ("reduce_scatter", output.dtype, out_t.numel, input.dtype, input.size, op)
            plan = (out_t.dtype, reduce_op, fingerprint("reduce_scatter", out_t.dtype, out_t.numel, reduce_op))
            self._remember(key, plan, output, input)

        tensors = device_blocks(blocks, out_t.dtype) if dev else []
        host = self._host

        def body(call: Call) -> None:
            if dev:
                dev.reduce_scatter(call, BoundHost(host, call), out_t, tensors, reduce_op)
            elif call.size == 1:
                out[...] = blocks[0]
            elif native:
                _native.reduce_scatter(native, call, out, blocks, out_t.dtype, reduce_op)
            else:
                _ring.reduce_scatter(call, out, blocks, kernel, divisor)

        fp = fingerprint("reduce_scatter", out_t.dtype, out_t.numel, reduce_op, direct=dev is not None and dev.direct)
        route = _route_name(dev, native, "ring")
        return self._runner.launch(
            "reduce_scatter", body, fp, async_op=async_op, timeout=timeout, shape=out_t.shape, route=route
        )

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
        if self._rank == root:
            blocks = check.blocks(
                check.present(gather_list, "gather_list"), t, self.size, "gather_list", writeable=True
            )
        else:
            check.absent(gather_list, "gather_list", "dst", root)
            blocks = None
        x = t.flat()
        dev, native = self._route("gather", [t, *check.seen])
        fp = fingerprint("gather", t.dtype, t.numel, root=root, direct=dev is not None and dev.direct)
        tensors = device_blocks(blocks, t.dtype) if dev and blocks is not None else None
        return self._runner.launch(
            "gather",
            (lambda call: dev.gather(call, t, tensors, root))
            if dev
            else (lambda call: _native.gather(native, call, x, blocks, root, t.dtype))
            if native
            else (lambda call: _direct.gather(call, x, blocks, root)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
            route=_route_name(dev, native, "direct"),
        )

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
        if self._rank == root:
            blocks = check.blocks(
                check.present(scatter_list, "scatter_list"), t, self.size, "scatter_list", writeable=False
            )
        else:
            check.absent(scatter_list, "scatter_list", "src", root)
            blocks = None
        x = t.flat()
        dev, native = self._route("scatter", [t, *check.seen])
        fp = fingerprint("scatter", t.dtype, t.numel, root=root, direct=dev is not None and dev.direct)
        tensors = device_blocks(blocks, t.dtype) if dev and blocks is not None else None
        return self._runner.launch(
            "scatter",
            (lambda call: dev.scatter(call, t, tensors, root))
            if dev
            else (lambda call: _native.scatter(native, call, x, blocks, root, t.dtype))
            if native
            else (lambda call: _direct.scatter(call, x, blocks, root)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
            route=_route_name(dev, native, "direct"),
        )

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
        me = self._member_rank("all_to_all")
        check.same_kind(ins[me], outs[me], f"inputs[{me}] (kept by this rank)")
        out_flat, in_flat = [o.flat() for o in outs], [t.flat() for t in ins]
        dev, _ = self._route("all_to_all", [*outs, *ins])  # no transport has its own all_to_all
        # Block sizes may differ per pair: they are not in the fingerprint.
        fp = fingerprint("all_to_all", ins[0].dtype, direct=dev is not None and dev.direct)
        return self._runner.launch(
            "all_to_all",
            (lambda call: dev.all_to_all(call, outs, ins))
            if dev
            else (lambda call: _direct.all_to_all(call, out_flat, in_flat)),
            fp,
            async_op=async_op,
            timeout=timeout,
            route=_route_name(dev, None, "direct"),
        )

    def barrier(self, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Return once every rank of the group has entered ``barrier`` (dissemination rounds)."""
        self._checker("barrier")
        native = self._native
        body = (lambda call: native.barrier(call.deadline, call.fingerprint, call.seq)) if native else _tree.barrier
        route = "transport" if native else "dissemination"
        return self._runner.launch(
            "barrier", body, fingerprint("barrier"), async_op=async_op, timeout=timeout, route=route
        )

    # -- lifetime --------------------------------------------------------------------------------
    def _shutdown(self, timeout: float = 5.0) -> None:
        """Finish queued async work and stop the worker (and those of the groups derived
        from this one); the group cannot be used afterwards."""
        for child in list(self._children):
            child._shutdown(timeout)
        self._destroyed = True
        self._runner.stop(timeout)
        native, self._native = self._native, None
        self._host = HostCollectives(None)
        if native is not None:
            native.free()
        self._devices.close()


def _route_name(dev: DeviceEngine | None, native: Any, ours: str) -> str:
    """Where a call runs, for the trace: the device engine, the transport's own
    collectives, or ours (``ours`` names the algorithm)."""
    if dev is not None:
        return dev.name
    return "transport" if native else ours


if TYPE_CHECKING:  # ProcessGroup satisfies core's Group protocol (checked by mypy)
    _protocol_check: type[Group] = ProcessGroup
