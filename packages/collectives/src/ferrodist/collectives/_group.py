"""``ProcessGroup``: a set of ranks and the collectives they run together.

Ranks passed to a ``ProcessGroup`` method are *group* ranks (0 .. size-1), as on
``torch.distributed.ProcessGroup`` objects; the module-level functions take global
ranks and translate. Every argument is checked before a byte moves; every call has
a deadline; an error names the rank, the call and its sequence number.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ferrodist.core import (
    CollectiveMismatch,
    CollectiveTimeout,
    FerrodistError,
    InvalidArgument,
    InvalidRank,
    ReduceOp,
    Tensor,
    bfloat16,
    reducer,
)
from ferrodist.transport import Transport

from . import _device, _direct, _doubling, _native, _ring, _tree
from ._call import MAX_USER_TAG, Call, Scratch, collective_tag, p2p_tag
from ._census import absent_ranks
from ._checks import Checker, flats, split_equally
from ._debug import check_agreement
from ._fingerprint import describe, fingerprint
from ._record import record_failure
from ._select import all_reduce_algorithm
from ._work import RequestWork, Work, Worker

Body = Callable[[Call], None]


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
    ) -> None:
        self._transport = transport
        self._debug = debug
        # The transport's own collectives for these ranks (MPI's), or None. Every rank of the
        # world builds every group, so a transport may make this a collective call.
        make_native = getattr(transport, "native_collectives", None)
        self._native: Any = make_native(tuple(ranks)) if make_native is not None else None
        self._ranks = tuple(ranks)
        self._group_id = group_id
        self._timeout = float(timeout)
        self._name = name
        self._global_rank = transport.rank
        self._rank = self._ranks.index(self._global_rank) if self._global_rank in self._ranks else None
        self._seq = itertools.count()
        self._scratch = Scratch()
        self._worker: Worker | None = None
        self._worker_lock = threading.Lock()
        self._child_ids = itertools.count(1)  # ids of the groups new_group derives from this one
        self._children: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()
        # (operation, numpy dtypes, element counts, op or root as given) -> what the checks
        # worked out for calls on plain numpy arrays already validated once (DType, op or
        # root, fingerprint): later calls of the same kind go straight to the transport.
        self._fast_plans: dict[tuple[Any, ...], tuple[Any, Any, int]] = {}
        self._destroyed = False

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

    def _derive(self, ranks: Sequence[int], timeout: float | None) -> ProcessGroup:
        """A group of some of this group's ranks (global ranks), shut down along with this one."""
        group_id = next(self._child_ids)
        child = ProcessGroup(
            self._transport,
            ranks,
            group_id,
            timeout=self._timeout if timeout is None else timeout,
            name=f"{group_id}{list(ranks)}",
            debug=self._debug,
        )
        self._children.add(child)
        return child

    # -- running a call ------------------------------------------------------------------------
    def _launch(
        self,
        operation: str,
        body: Body,
        fp: int,
        *,
        async_op: bool,
        timeout: float | None,
        shape: tuple[int, ...] = (),
    ) -> Work | None:
        """Run ``body`` as the next call of this group (now, or on the async worker).

        ``fp`` is the call's fingerprint (see ``_fingerprint``): every message of the call
        carries it, and a peer in another call is reported as a ``CollectiveMismatch``.
        In debug mode the ranks first compare ``fp`` and ``shape`` (see ``_debug``).
        """
        rank = self._member_rank(operation)
        limit = self._limit(timeout, operation)
        seq = next(self._seq)  # itertools.count: atomic under the GIL
        tag = collective_tag(self._group_id, seq)

        def run() -> None:
            call = Call(self._transport, self._ranks, rank, tag, time.monotonic() + limit, self._scratch, fp)
            try:
                if self._debug:
                    check_agreement(call, shape)
                body(call)
            except FerrodistError as exc:
                raise self._frame(exc, operation, seq, limit).with_traceback(exc.__traceback__) from None

        if not async_op:
            run()
            return None
        work = Work(f"{operation} #{seq} on group {self._name}")
        self._get_worker().submit(run, work)
        return work

    def _frame(self, exc: FerrodistError, operation: str, seq: int, limit: float) -> FerrodistError:
        """``exc`` with the call's context: the rank, the operation, its number, the group;
        what each rank called for a mismatch; the ranks that never arrived for a timeout."""
        context = (
            f"rank {self._global_rank}: {operation} #{seq} on group {self._name} "
            f"(group rank {self._rank} of {self.size})"
        )
        framed = exc.with_context(context, rank=self._global_rank, operation=operation)
        if isinstance(exc, CollectiveMismatch) and exc.received:
            framed.args = (
                f"{context}: rank {exc.peer} is in {describe(exc.received)} while this rank is in "
                f"{describe(exc.expected)}: every rank must make the same collective calls in the "
                "same order with the same dtype, size, op and root",
            )
        elif isinstance(exc, CollectiveTimeout):
            absent = absent_ranks(self._transport, self._group_id, seq, self._ranks, min(1.0, limit))
            if absent:
                framed.args = (f"{framed.message}; ranks that never reached call #{seq}: {absent}",)
                framed.waiting_for = tuple(absent)  # type: ignore[attr-defined]
            elif absent == []:
                framed.args = (
                    f"{framed.message}; every rank reached call #{seq}, so a transfer inside it is "
                    "stuck or too slow for the timeout",
                )
        record_failure(framed)  # for the launcher: this rank's own error, or another rank's
        return framed

    def _limit(self, timeout: float | None, operation: str) -> float:
        if timeout is None:
            return self._timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidArgument(
                f"rank {self._global_rank}: {operation}: timeout must be a positive number of seconds, not {timeout!r}",
                rank=self._global_rank,
                operation=operation,
            )
        return float(timeout)

    def _get_worker(self) -> Worker:
        with self._worker_lock:
            if self._worker is None:
                self._worker = Worker(f"ferrodist-{self._name}-rank{self._global_rank}")
            return self._worker

    def _fast_native(self, native: Any, timeout: float | None, async_op: bool) -> bool:
        """Whether this call may take the fast path (the transport's own collectives, no options)."""
        return native is not None and not (async_op or timeout or self._debug)

    def _remember(self, key: tuple[Any, ...], plan: tuple[Any, Any, int], *arrays: Any) -> None:
        """Keep ``plan`` for ``key`` when every array of the call is a plain numpy array."""
        if self._debug or not all(type(a) is np.ndarray for a in arrays):
            return
        if len(self._fast_plans) > 1024:
            self._fast_plans.clear()
        self._fast_plans[key] = plan

    def _fast(self, operation: str, run: Callable[[float], None]) -> None:
        """Run a call validated before (see ``_fast_plans``): ``run(deadline)`` on the transport."""
        if self._destroyed:
            self._member_rank(operation)  # raises
        seq = next(self._seq)
        try:
            run(time.monotonic() + self._timeout)
        except FerrodistError as exc:
            raise self._frame(exc, operation, seq, self._timeout).with_traceback(exc.__traceback__) from None

    def _fast_call(self, operation: str, fp: int, body: Body) -> None:
        """Run a call validated before with one of our algorithms: ``body(call)``, in this thread."""
        rank = self._rank
        if rank is None or self._destroyed:
            rank = self._member_rank(operation)  # raises
        seq = next(self._seq)
        call = Call(
            self._transport,
            self._ranks,
            rank,
            collective_tag(self._group_id, seq),
            time.monotonic() + self._timeout,
            self._scratch,
            fp,
        )
        try:
            body(call)
        except FerrodistError as exc:
            raise self._frame(exc, operation, seq, self._timeout).with_traceback(exc.__traceback__) from None

    def _native_for(self, t: Tensor, op: ReduceOp | None = None, algorithm: str | None = None) -> Any:
        """The transport's own collectives when they can do this call (and the caller did
        not ask for one of ours), else None."""
        if self._native is None or algorithm not in (None, "auto") or not self._native.supports(t.dtype, op):
            return None
        return self._native

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
        timeout: float | None = None,
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
        if type(tensor) is np.ndarray and not (async_op or timeout or algorithm or compress or self._debug):
            plan = self._fast_plans.get(("all_reduce", tensor.dtype, op, tensor.size))
            if plan is not None and tensor.flags.c_contiguous and tensor.flags.writeable:
                dt, how, fp = plan
                if dt is None:  # one of our algorithms: (engine, kernel, divisor)
                    engine, kernel, divisor = how
                    self._fast_call("all_reduce", fp, lambda call: engine(call, tensor.reshape(-1), kernel, divisor))
                else:
                    self._fast(
                        "all_reduce", lambda deadline: native.all_reduce(tensor.reshape(-1), dt, how, deadline, fp)
                    )
                return None
        check = self._checker("all_reduce")
        t = check.tensor(tensor, writeable=True)
        reduce_op = check.op(op, t)
        name = all_reduce_algorithm(t.nbytes, self.size, algorithm, rank=self._global_rank)
        divisor = float(self.size) if reduce_op is ReduceOp.AVG else 1.0
        x = t.flat()
        dev = _device.engine(self._global_rank, "all_reduce", [t])
        wire = _compression(check, compress, t, dev)
        fp = fingerprint("all_reduce", wire, t.numel, reduce_op)
        if dev is not None:
            return self._launch(
                "all_reduce",
                lambda call: dev.all_reduce(call, x, t.dtype, reduce_op, divisor, wire),
                fp,
                async_op=async_op,
                timeout=timeout,
                shape=t.shape,
            )
        engine = _ring.all_reduce if name == "ring" else _doubling.all_reduce
        kernel = reducer(t.dtype, reduce_op)
        native = self._native_for(t, reduce_op, algorithm)
        if native is not None and t.nbytes > getattr(native, "all_reduce_up_to", t.nbytes):
            native = None  # the transport's own all_reduce is slower than ours at this size
        if type(tensor) is np.ndarray and not (algorithm or compress):
            self._remember(
                ("all_reduce", tensor.dtype, op, t.numel),
                (t.dtype, reduce_op, fp) if native is not None else (None, (engine, kernel, divisor), fp),
                tensor,
            )
        return self._launch(
            "all_reduce",
            (lambda call: native.all_reduce(x, t.dtype, reduce_op, call.deadline, call.fingerprint))
            if native
            else (lambda call: engine(call, x, kernel, divisor)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
        )

    def broadcast(
        self, tensor: Any, src: int = 0, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
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
                self._fast("broadcast", lambda deadline: native.broadcast(tensor.reshape(-1), root, dt, deadline, fp))
                return None
        check = self._checker("broadcast")
        root = check.root(src, self.size, "src")
        t = check.tensor(tensor, writeable=self._rank != root)
        x = t.flat()
        fp = fingerprint("broadcast", t.dtype, t.numel, root=root)
        dev = _device.engine(self._global_rank, "broadcast", [t])
        native = None if dev else self._native_for(t)
        if native is not None and type(tensor) is np.ndarray:
            self._remember(("broadcast", tensor.dtype, t.numel, src), (t.dtype, root, fp), tensor)
        return self._launch(
            "broadcast",
            (lambda call: dev.broadcast(call, x, root))
            if dev
            else (lambda call: native.broadcast(x, root, t.dtype, call.deadline, call.fingerprint))
            if native
            else (lambda call: _tree.broadcast(call, x, root)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
        )

    def reduce(
        self,
        tensor: Any,
        dst: int = 0,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
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
        fp = fingerprint("reduce", t.dtype, t.numel, reduce_op, root)
        dev = _device.engine(self._global_rank, "reduce", [t])
        native = None if dev else self._native_for(t, reduce_op)
        return self._launch(
            "reduce",
            (lambda call: dev.reduce(call, x, root, t.dtype, reduce_op, divisor))
            if dev
            else (lambda call: native.reduce(x, root, t.dtype, reduce_op, call.deadline, call.fingerprint))
            if native
            else (lambda call: _tree.reduce(call, x, root, kernel, divisor)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
        )

    def all_gather(
        self, output: Any, tensor: Any, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
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
                self._fast(
                    "all_gather",
                    lambda deadline: native.all_gather(tensor.reshape(-1), output.reshape(-1), dt, deadline, fp),
                )
                return None
        check = self._checker("all_gather")
        t = check.tensor(tensor)
        blocks = check.blocks(output, t, self.size, "output", writeable=True)
        x = t.flat()
        dev = _device.engine(self._global_rank, "all_gather", [t, *check.seen])
        native = None if dev else self._native_for(t)
        if native is not None and type(tensor) is np.ndarray and type(output) is np.ndarray:
            key = ("all_gather", tensor.dtype, t.numel, output.dtype, output.size)
            self._remember(key, (t.dtype, None, fingerprint("all_gather", t.dtype, t.numel)), tensor, output)

        def body(call: Call) -> None:
            if dev:
                dev.all_gather(call, x, blocks)
                return
            if native:
                _native.all_gather(native, call, x, blocks, t.dtype)
                return
            blocks[call.rank][...] = x
            _ring.all_gather(call, blocks)

        fp = fingerprint("all_gather", t.dtype, t.numel)
        return self._launch("all_gather", body, fp, async_op=async_op, timeout=timeout, shape=t.shape)

    def reduce_scatter(
        self,
        output: Any,
        input: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
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
                self._fast(
                    "reduce_scatter",
                    lambda deadline: native.reduce_scatter(
                        input.reshape(-1), output.reshape(-1), dt, reduce_op, deadline, fp
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
        dev = _device.engine(self._global_rank, "reduce_scatter", [out_t, *check.seen])
        native = None if dev else self._native_for(out_t, reduce_op)
        if native is not None and self.size > 1 and type(output) is np.ndarray and type(input) is np.ndarray:
            key = ("reduce_scatter", output.dtype, out_t.numel, input.dtype, input.size, op)
            plan = (out_t.dtype, reduce_op, fingerprint("reduce_scatter", out_t.dtype, out_t.numel, reduce_op))
            self._remember(key, plan, output, input)

        def body(call: Call) -> None:
            if dev:
                dev.reduce_scatter(call, out, blocks, out_t.dtype, reduce_op, divisor)
            elif call.size == 1:
                out[...] = blocks[0]
            elif native:
                _native.reduce_scatter(native, call, out, blocks, out_t.dtype, reduce_op)
            else:
                _ring.reduce_scatter(call, out, blocks, kernel, divisor)

        fp = fingerprint("reduce_scatter", out_t.dtype, out_t.numel, reduce_op)
        return self._launch("reduce_scatter", body, fp, async_op=async_op, timeout=timeout, shape=out_t.shape)

    def gather(
        self,
        tensor: Any,
        gather_list: Any = None,
        dst: int = 0,
        *,
        async_op: bool = False,
        timeout: float | None = None,
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
        fp = fingerprint("gather", t.dtype, t.numel, root=root)
        dev = _device.engine(self._global_rank, "gather", [t, *check.seen])
        native = None if dev else self._native_for(t)
        return self._launch(
            "gather",
            (lambda call: dev.gather(call, x, blocks, root))
            if dev
            else (lambda call: _native.gather(native, call, x, blocks, root, t.dtype))
            if native
            else (lambda call: _direct.gather(call, x, blocks, root)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
        )

    def scatter(
        self,
        tensor: Any,
        scatter_list: Any = None,
        src: int = 0,
        *,
        async_op: bool = False,
        timeout: float | None = None,
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
        fp = fingerprint("scatter", t.dtype, t.numel, root=root)
        dev = _device.engine(self._global_rank, "scatter", [t, *check.seen])
        native = None if dev else self._native_for(t)
        return self._launch(
            "scatter",
            (lambda call: dev.scatter(call, x, blocks, root))
            if dev
            else (lambda call: _native.scatter(native, call, x, blocks, root, t.dtype))
            if native
            else (lambda call: _direct.scatter(call, x, blocks, root)),
            fp,
            async_op=async_op,
            timeout=timeout,
            shape=t.shape,
        )

    def all_to_all(
        self, outputs: Any, inputs: Any, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
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
        out_flat, in_flat = flats(outs), flats(ins)
        fp = fingerprint("all_to_all", ins[0].dtype)  # block sizes may differ per pair: not in the fingerprint
        dev = _device.engine(self._global_rank, "all_to_all", [*outs, *ins])
        return self._launch(
            "all_to_all",
            (lambda call: dev.all_to_all(call, out_flat, in_flat))
            if dev
            else (lambda call: _direct.all_to_all(call, out_flat, in_flat)),
            fp,
            async_op=async_op,
            timeout=timeout,
        )

    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Work | None:
        """Return once every rank of the group has entered ``barrier`` (dissemination rounds)."""
        self._checker("barrier")
        native = self._native
        body = (lambda call: native.barrier(call.deadline, call.fingerprint)) if native else _tree.barrier
        return self._launch("barrier", body, fingerprint("barrier"), async_op=async_op, timeout=timeout)

    # -- point to point ------------------------------------------------------------------------
    def _p2p(
        self, operation: str, tensor: Any, peer: int, tag: int, *, writeable: bool
    ) -> tuple[Any, int, int, str, Any]:
        check = self._checker(operation)
        peer_rank = check.root(peer, self.size, "dst" if operation in ("send", "isend") else "src")
        if peer_rank == self._rank:
            raise check.fail(f"peer {peer_rank} is this rank itself; copy the data locally", InvalidRank)
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_USER_TAG:
            raise check.fail(f"tag must be an integer in 0..{MAX_USER_TAG}, not {tag!r}")
        t = check.tensor(tensor, writeable=writeable)
        context = f"rank {self._global_rank}: {operation} with group rank {peer_rank} (tag {tag}) on group {self._name}"
        dev = _device.engine(self._global_rank, operation, [t])
        return t.flat(), self._ranks[peer_rank], p2p_tag(self._group_id, tag), context, dev

    def _start(self, x: Any, peer: int, tag: int, dev: Any, *, sending: bool) -> Any:
        if dev is not None:
            return (dev.isend if sending else dev.irecv)(self._transport, x, peer, tag)
        return (self._transport.isend if sending else self._transport.irecv)(x, peer, tag)

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to group rank ``dst``; don't modify it until ``wait()`` returns."""
        x, peer, wire_tag, context, dev = self._p2p("isend", tensor, dst, tag, writeable=False)
        request = self._start(x, peer, wire_tag, dev, sending=True)
        return RequestWork(context, request, self._timeout, context)

    def irecv(self, tensor: Any, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from group rank ``src``; read it after ``wait()``."""
        x, peer, wire_tag, context, dev = self._p2p("irecv", tensor, src, tag, writeable=True)
        request = self._start(x, peer, wire_tag, dev, sending=False)
        return RequestWork(context, request, self._timeout, context)

    def send(self, tensor: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``tensor`` to group rank ``dst`` (matched by a ``recv`` there with the same tag)."""
        x, peer, wire_tag, context, dev = self._p2p("send", tensor, dst, tag, writeable=False)
        request = self._start(x, peer, wire_tag, dev, sending=True)
        RequestWork(context, request, self._limit(timeout, "send"), context).wait()

    def recv(self, tensor: Any, src: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Receive into ``tensor`` from group rank ``src`` (the message must have its exact size)."""
        x, peer, wire_tag, context, dev = self._p2p("recv", tensor, src, tag, writeable=True)
        request = self._start(x, peer, wire_tag, dev, sending=False)
        RequestWork(context, request, self._limit(timeout, "recv"), context).wait()

    # -- lifetime --------------------------------------------------------------------------------
    def _shutdown(self, timeout: float = 5.0) -> None:
        """Finish queued async work and stop the worker (and those of the groups derived
        from this one); the group cannot be used afterwards."""
        for child in list(self._children):
            child._shutdown(timeout)
        self._destroyed = True
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop(timeout)
        native, self._native = self._native, None
        if native is not None:
            native.free()


def _compression(check: Checker, compress: str | None, t: Tensor, dev: Any) -> Any:
    """The dtype that travels for ``all_reduce(..., compress=...)``: the tensor's own, or bfloat16."""
    if compress is None:
        return t.dtype
    if compress != "bf16":
        raise check.fail(f"compress={compress!r} is unknown; use compress='bf16' or leave it out")
    if dev is None:
        raise check.fail("compress='bf16' applies to CUDA tensors; CPU tensors are reduced at full precision")
    if t.dtype.name != "float32":
        raise check.fail(f"compress='bf16' needs a float32 tensor, not {t.dtype.name}")
    return bfloat16
