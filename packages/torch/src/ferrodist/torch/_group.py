"""``FerrodistProcessGroup``: torch's ``ProcessGroup`` interface over a ferrodist group.

torch calls these methods from Python (``torch.distributed.all_reduce`` calls
``group.allreduce``) and from C++ through its Python trampoline (DDP's reducer,
``_broadcast_coalesced``, parameter verification, functional collectives). Each method
turns torch's tensors and options into one call of the ferrodist ``ProcessGroup``
(group ranks are the same in both), blocking when torch says ``asyncOp=False`` and on
the group's worker otherwise, and returns a ``FerrodistWork``.

The default torch group gets a ferrodist group over a transport of its own; later torch
groups are subgroups of it (``ProcessGroup.subgroup``): the same transport, their own
channel, call numbering and worker, so calls on two groups never share state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from ferrodist.collectives import ProcessGroup, destroy_process_group
from ferrodist.core import InvalidArgument, ReduceOp, host_view

from . import _forms as forms
from ._names import BACKEND_NAME
from ._sparse import sparse_all_reduce
from ._tensors import REDUCE_OPS, Staging, single
from ._work import Completer, FerrodistWork, seconds


class FerrodistProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """A torch ``ProcessGroup`` whose collectives run on a ferrodist group.

    Made by torch when a process group is created with backend ``"ferrodist"``
    (``init_process_group``, ``new_group``, a ``DeviceMesh``); see ``ferrodist.torch``.

    Attributes:
        ferrodist_group: the ferrodist ``ProcessGroup`` it runs on (its transport says
            which one was chosen).
        store: torch's store of this group (prefixed for it), which the group started through.
    """

    def __init__(self, group: ProcessGroup, store: Any, *, description: str, owns_transport: bool = True) -> None:
        # torch 2.13 builds Python subclasses through its trampoline from (rank, size) only
        super().__init__(group.rank, group.size)  # type: ignore[call-arg]
        self.store = store
        self.ferrodist_group = group
        self._description = description
        self._completer = Completer(f"ferrodist-torch-{description}-futures")
        self._calls = 0
        self._closed = False
        self._owns_transport = owns_transport  # False for a subgroup over its world's transport
        self._group_name = description
        self._group_desc = "undefined"

    # -- identity -------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch names a group after it is made (``_set_group_name``); a Python group keeps the
    # name itself (torch's own keeps it in its C++ backends, which this group has none of)
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, description: str) -> None:
        self._group_desc = description

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        group = self.ferrodist_group
        return (
            f"<FerrodistProcessGroup {self._description} rank={group.rank} size={group.size} "
            f"over {type(group.transport).__name__}>"
        )

    # -- plumbing -------------------------------------------------------------------------------
    def _run(
        self,
        operation: str,
        opts: Any,
        call: Callable[[Staging, bool, float | None], Any],
        result: list[torch.Tensor],
    ) -> FerrodistWork:
        """Run one collective: ``call(staging, async_op, timeout)`` issues it on the ferrodist
        group (raising at once for bad arguments); blocking unless ``opts.asyncOp``."""
        staging = Staging(self.ferrodist_group.rank, operation)
        async_op = bool(opts.asyncOp)
        timeout = seconds(opts.timeout, operation)
        self._calls += 1
        description = f"{operation} #{self._calls} on group {self._description}"
        inner = call(staging, async_op, timeout)
        if not async_op or inner is None:
            staging.finish()
            return FerrodistWork(description, None, result)
        return FerrodistWork(description, inner, result, finish=staging.finish, completer=self._completer)

    def _op(self, opts: Any, operation: str) -> ReduceOp:
        kind = opts.reduceOp.op
        name = getattr(kind, "name", str(kind))
        if name not in REDUCE_OPS:
            raise InvalidArgument(
                f"rank {self.ferrodist_group.rank}: {operation}: ReduceOp.{name} is not supported by the ferrodist "
                f"backend (it has {', '.join(REDUCE_OPS)}); scale the tensor yourself and use SUM",
                rank=self.ferrodist_group.rank,
                operation=operation,
            )
        return ReduceOp[name]

    def _one(self, tensors: Sequence[Any], operation: str, what: str = "tensors") -> Any:
        return single(tensors, self.ferrodist_group.rank, operation, what)

    def _host(self, tensors: Any, opts: Any, kind: Any) -> Any:
        """The one CPU tensor of a blocking call in torch's long form (``[tensor]`` and
        options of ``kind``, what ``torch.distributed``'s functions pass), as the array
        ferrodist takes; None for anything else, which the general path checks and stages."""
        if type(opts) is not kind or type(tensors) is not list or len(tensors) != 1 or opts.asyncOp:
            return None
        tensor = tensors[0]
        return host_view(tensor) if isinstance(tensor, torch.Tensor) else None

    def _done(self, operation: str, result: list[torch.Tensor]) -> FerrodistWork:
        self._calls += 1
        return FerrodistWork.done(f"{operation} #{self._calls} on group {self._description}", result)

    # -- reductions -------------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None, timeout: Any = None) -> FerrodistWork:  # type: ignore[override]
        """``allreduce([tensor], opts)``, or ``allreduce(tensor or [tensor], op, timeout)``."""
        array = self._host(tensors, opts, _ALLREDUCE)
        if array is not None and (op := _OPS.get(opts.reduceOp.op.value)) is not None:
            # a blocking call on a CPU tensor: straight to the group, no staging, no worker
            self.ferrodist_group.all_reduce(array, op, timeout=_seconds(opts, "allreduce"))
            return self._done("allreduce", tensors)
        tensors, opts = _listed(tensors), forms.reduce_options(c10d.AllreduceOptions, opts, timeout)
        tensor = self._one(tensors, "allreduce")
        op = self._op(opts, "allreduce")
        g = self.ferrodist_group
        if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided:
            # sparse COO with SUM (three blocking calls: done when this returns), or refused
            return self._run("allreduce", opts, lambda s, a, t: sparse_all_reduce(g, tensor, op.name, t), tensors)
        return self._run(
            "allreduce",
            opts,
            lambda s, a, t: g.all_reduce(s.arg(tensor, output=True), op, async_op=a, timeout=t),
            tensors,
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> FerrodistWork:
        """Each tensor all-reduced with the same op, in order (one work for all)."""
        opts = c10d.AllreduceCoalescedOptions() if opts is None else opts
        op = self._op(opts, "allreduce_coalesced")
        g = self.ferrodist_group

        def call(s: Staging, a: bool, t: float | None) -> Any:
            arrays = s.args(tensors, output=True, what="tensors")
            works = [g.all_reduce(x, op, async_op=a, timeout=t) for x in arrays]
            return _Last(works) if a else None

        return self._run("allreduce_coalesced", opts, call, tensors)

    def reduce(self, tensors: Any, opts: Any = None, op: Any = None, timeout: Any = None) -> FerrodistWork:  # type: ignore[override]
        """``reduce([tensor], opts)``, or ``reduce(tensor, root, op, timeout)``."""
        tensors, opts = _listed(tensors), forms.rooted_options(c10d.ReduceOptions, opts, timeout, op)
        tensor = self._one(tensors, "reduce")
        op = self._op(opts, "reduce")
        g = self.ferrodist_group
        root = int(opts.rootRank)
        return self._run(
            "reduce",
            opts,
            lambda s, a, t: g.reduce(s.arg(tensor, output=g.rank == root), root, op, async_op=a, timeout=t),
            tensors,
        )

    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> FerrodistWork:
        """``reduce_scatter([output], [inputs], opts)``, or ``reduce_scatter(output, inputs, op, timeout)``."""
        if isinstance(output_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        opts = forms.reduce_options(c10d.ReduceScatterOptions, opts, timeout)
        output = self._one(output_tensors, "reduce_scatter", "output_tensors")
        inputs = self._one(input_tensors, "reduce_scatter", "input_tensors")
        op = self._op(opts, "reduce_scatter")
        g = self.ferrodist_group
        return self._run(
            "reduce_scatter",
            opts,
            lambda s, a, t: g.reduce_scatter(
                s.arg(output, output=True), s.args(inputs, output=False, what="input_list"), op, async_op=a, timeout=t
            ),
            output_tensors,
        )

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> FerrodistWork:
        """``reduce_scatter_tensor``: ``input`` holds ``size`` blocks shaped like ``output``."""
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        op = self._op(opts, "reduce_scatter_tensor")
        g = self.ferrodist_group
        return self._run(
            "reduce_scatter_tensor",
            opts,
            lambda s, a, t: g.reduce_scatter(
                s.arg(output, output=True), s.arg(input, output=False, what="input"), op, async_op=a, timeout=t
            ),
            [output],
        )

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> FerrodistWork:
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        op = self._op(opts, "reduce_scatter_tensor_coalesced")
        g = self.ferrodist_group
        _same_count(outputs, inputs, g.rank, "reduce_scatter_tensor_coalesced")

        def call(s: Staging, a: bool, t: float | None) -> Any:
            pairs = [
                (s.arg(o, output=True), s.arg(i, output=False, what="inputs"))
                for o, i in zip(outputs, inputs, strict=True)
            ]
            works = [g.reduce_scatter(o, i, op, async_op=a, timeout=t) for o, i in pairs]
            return _Last(works) if a else None

        return self._run("reduce_scatter_tensor_coalesced", opts, call, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # -- copies -------------------------------------------------------------------------------------
    def broadcast(self, tensors: Any, opts: Any = None, timeout: Any = None) -> FerrodistWork:  # type: ignore[override]
        """``broadcast([tensor], opts)``, or ``broadcast(tensor, root, timeout)``."""
        array = self._host(tensors, opts, _BROADCAST)
        if array is not None:  # a blocking call on a CPU tensor: straight to the group
            self.ferrodist_group.broadcast(array, opts.rootRank, timeout=_seconds(opts, "broadcast"))
            return self._done("broadcast", tensors)
        tensors, opts = _listed(tensors), forms.rooted_options(c10d.BroadcastOptions, opts, timeout)
        tensor = self._one(tensors, "broadcast")
        g = self.ferrodist_group
        root = int(opts.rootRank)
        return self._run(
            "broadcast",
            opts,
            lambda s, a, t: g.broadcast(s.arg(tensor, output=g.rank != root), root, async_op=a, timeout=t),
            tensors,
        )

    def allgather(  # type: ignore[override]
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> FerrodistWork:
        """``allgather([outputs], [tensor], opts)``, or ``allgather(outputs, tensor, timeout)``."""
        if isinstance(input_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        opts = forms.plain_options(c10d.AllgatherOptions, opts)
        outputs = self._one(output_tensors, "allgather", "output_tensors")
        tensor = self._one(input_tensors, "allgather", "input_tensors")
        g = self.ferrodist_group
        return self._run(
            "allgather",
            opts,
            lambda s, a, t: g.all_gather(
                s.args(outputs, output=True, what="tensor_list"), s.arg(tensor, output=False), async_op=a, timeout=t
            ),
            outputs,
        )

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> FerrodistWork:
        """``all_gather_coalesced`` in torch's layout: ``output_lists[r][i]`` receives group
        rank r's ``input_tensors[i]`` (one list per rank, one tensor per input)."""
        opts = c10d.AllgatherOptions() if opts is None else opts
        g = self.ferrodist_group
        _rank_major(output_lists, input_tensors, g.rank, g.size, "allgather_coalesced")

        def call(s: Staging, a: bool, t: float | None) -> Any:
            pairs = [
                (
                    [
                        s.arg(outs[i], output=True, what=f"output_tensor_lists[{r}][{i}]")
                        for r, outs in enumerate(output_lists)
                    ],
                    s.arg(x, output=False, what=f"input_tensor_list[{i}]"),
                )
                for i, x in enumerate(input_tensors)
            ]
            works = [g.all_gather(outs, x, async_op=a, timeout=t) for outs, x in pairs]
            return _Last(works) if a else None

        return self._run("allgather_coalesced", opts, call, [t for outs in output_lists for t in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> FerrodistWork:
        """``all_gather_into_tensor``: ``output`` holds ``size`` blocks shaped like ``input``."""
        opts = c10d.AllgatherOptions() if opts is None else opts
        g = self.ferrodist_group
        return self._run(
            "all_gather_into_tensor",
            opts,
            lambda s, a, t: g.all_gather(
                s.arg(output, output=True, what="output"), s.arg(input, output=False), async_op=a, timeout=t
            ),
            [output],
        )

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> FerrodistWork:
        opts = c10d.AllgatherOptions() if opts is None else opts
        g = self.ferrodist_group
        _same_count(outputs, inputs, g.rank, "all_gather_into_tensor_coalesced")

        def call(s: Staging, a: bool, t: float | None) -> Any:
            pairs = [(s.arg(o, output=True), s.arg(i, output=False)) for o, i in zip(outputs, inputs, strict=True)]
            works = [g.all_gather(o, i, async_op=a, timeout=t) for o, i in pairs]
            return _Last(works) if a else None

        return self._run("all_gather_into_tensor_coalesced", opts, call, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def gather(  # type: ignore[override]
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> FerrodistWork:
        """``gather([outputs] on the root else [], [tensor], opts)``, or ``gather(outputs, tensor, root, timeout)``."""
        opts = forms.rooted_options(c10d.GatherOptions, opts, timeout)
        if isinstance(input_tensors, torch.Tensor):
            at_root = self.ferrodist_group.rank == int(opts.rootRank)
            output_tensors, input_tensors = ([output_tensors] if at_root else []), [input_tensors]
        tensor = self._one(input_tensors, "gather", "input_tensors")
        g = self.ferrodist_group
        root = int(opts.rootRank)
        outputs = self._one(output_tensors, "gather", "output_tensors") if g.rank == root else None
        return self._run(
            "gather",
            opts,
            lambda s, a, t: g.gather(
                s.arg(tensor, output=False),
                None if outputs is None else s.args(outputs, output=True, what="gather_list"),
                root,
                async_op=a,
                timeout=t,
            ),
            list(outputs or []),
        )

    def scatter(  # type: ignore[override]
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> FerrodistWork:
        """``scatter([tensor], [inputs] on the root else [], opts)``, or ``scatter(tensor, inputs, root, timeout)``."""
        opts = forms.rooted_options(c10d.ScatterOptions, opts, timeout)
        if isinstance(output_tensors, torch.Tensor):
            at_root = self.ferrodist_group.rank == int(opts.rootRank)
            output_tensors, input_tensors = [output_tensors], ([input_tensors] if at_root else [])
        tensor = self._one(output_tensors, "scatter", "output_tensors")
        g = self.ferrodist_group
        root = int(opts.rootRank)
        inputs = self._one(input_tensors, "scatter", "input_tensors") if g.rank == root else None
        return self._run(
            "scatter",
            opts,
            lambda s, a, t: g.scatter(
                s.arg(tensor, output=True),
                None if inputs is None else s.args(inputs, output=False, what="scatter_list"),
                root,
                async_op=a,
                timeout=t,
            ),
            output_tensors,
        )

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> FerrodistWork:
        opts = c10d.AllToAllOptions() if opts is None else opts
        g = self.ferrodist_group
        return self._run(
            "all_to_all",
            opts,
            lambda s, a, t: g.all_to_all(
                s.args(output_tensors, output=True, what="output_tensor_list"),
                s.args(input_tensors, output=False, what="input_tensor_list"),
                async_op=a,
                timeout=t,
            ),
            output_tensors,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> FerrodistWork:
        """``all_to_all_single``: with split sizes, rank i's rows ``input_split_sizes[j]`` go to
        rank j, which receives them as its rows ``output_split_sizes[i]`` (uneven splits);
        without, both tensors are cut into ``size`` equal blocks."""
        opts = c10d.AllToAllOptions() if opts is None else opts
        g = self.ferrodist_group

        def call(s: Staging, a: bool, t: float | None) -> Any:
            out = s.contiguous(output, output=True, what="output")
            inp = s.contiguous(input, output=False, what="input")
            outs = s.rows(out, output_split_sizes, g.size, what="output")
            ins = s.rows(inp, input_split_sizes, g.size, what="input")
            return g.all_to_all(outs, ins, async_op=a, timeout=t)

        return self._run("all_to_all_single", opts, call, [output])

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> FerrodistWork:
        opts = c10d.BarrierOptions() if opts is None else opts
        g = self.ferrodist_group
        return self._run("barrier", opts, lambda s, a, t: g.barrier(async_op=a, timeout=t), [])

    # -- point to point -------------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> FerrodistWork:
        tensor = self._one(tensors, "send")
        staging = Staging(self.ferrodist_group.rank, "send")
        inner = self.ferrodist_group.isend(staging.arg(tensor, output=False), int(dst), int(tag))
        return FerrodistWork(f"send to group rank {dst} (tag {tag})", inner, tensors, finish=staging.finish)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> FerrodistWork:
        tensor = self._one(tensors, "recv")
        staging = Staging(self.ferrodist_group.rank, "recv")
        inner = self.ferrodist_group.irecv(staging.arg(tensor, output=True), int(src), int(tag))
        return FerrodistWork(
            f"recv from group rank {src} (tag {tag})", inner, tensors, finish=staging.finish, source=lambda: int(src)
        )

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> FerrodistWork:
        """``recv``/``irecv`` without ``src``: the next message with ``tag`` that any other
        rank of the group sends (``work._source_rank()`` says whose)."""
        tensor = self._one(tensors, "recv_anysource")
        g = self.ferrodist_group
        staging = Staging(g.rank, "recv_anysource")
        inner = g.irecv(staging.arg(tensor, output=True), None, int(tag))

        def source() -> int:
            sender = inner.source
            assert sender is not None  # asked after the receive finished
            return sender

        return FerrodistWork(f"recv from any source (tag {tag})", inner, tensors, finish=staging.finish, source=source)

    # -- lifetime ---------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` ran."""
        return self._closed

    def shutdown(self) -> None:
        """Finish queued work (a few seconds at most) and close the transport unless it is
        the world group's that this subgroup shares (peers still waiting on this rank get
        ``PeerLost`` at once). Idempotent."""
        group = self.ferrodist_group
        if not self._closed:
            self._closed = True
            destroy_process_group(group)  # not a default group: stops its worker, keeps the transport
            self._completer.stop(5.0)
            if self._owns_transport:
                group.transport.close()

    def abort(self) -> None:
        self.shutdown()

    # -- shrinking (torch.distributed.shrink_group) -------------------------------------------
    @property
    def supports_shrinking(self) -> bool:
        """True: ``torch.distributed.shrink_group`` works on CPU tensors over ferrodist."""
        return True

    def shrink(
        self, ranks: Sequence[int] = (), flags: int = 0, options: Any = None, *, timeout: float | None = None
    ) -> FerrodistProcessGroup:
        """The group without ``ranks`` (group ranks), once every other member has agreed on it
        (``ProcessGroup.shrink``: a member gone or silent makes every caller raise, naming
        it); with no ``ranks``, without the members the live ones agree are lost. The new
        group runs on the same transport, which it then owns. ``ferrodist.torch.shrink_group``
        puts it in torch's place of this one."""
        group = self.ferrodist_group.shrink(exclude=list(ranks), timeout=timeout)
        made = FerrodistProcessGroup(group, self.store, description=group.name, owns_transport=self._owns_transport)
        self._owns_transport = False
        return made


class _Last:
    """The ferrodist works of a coalesced call, waited on as one (they run in order)."""

    def __init__(self, works: Sequence[Any]) -> None:
        self._works = [w for w in works if w is not None]

    def wait(self, timeout: float | None = None) -> None:
        for work in self._works:
            work.wait(timeout)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


_ALLREDUCE, _BROADCAST = c10d.AllreduceOptions, c10d.BroadcastOptions
#: torch's reduce op (``RedOpType``'s value) -> ferrodist's of the same name
_OPS = {getattr(c10d.ReduceOp.RedOpType, name).value: ReduceOp[name] for name in REDUCE_OPS}


#: What torch's options hold when nobody gave a timeout (the call's own deadline applies).
_NO_TIMEOUT = c10d.AllreduceOptions().timeout


def _seconds(opts: Any, operation: str) -> float | None:
    timeout = opts.timeout
    return None if timeout == _NO_TIMEOUT else seconds(timeout, operation)


def _listed(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


def _same_count(outputs: Sequence[Any], inputs: Sequence[Any], rank: int, operation: str) -> None:
    if len(outputs) != len(inputs):
        raise InvalidArgument(
            f"rank {rank}: {operation}: {len(outputs)} outputs for {len(inputs)} inputs; give one output per input",
            rank=rank,
            operation=operation,
        )


def _rank_major(outputs: Sequence[Any], inputs: Sequence[Any], rank: int, size: int, operation: str) -> None:
    """torch's ``output_tensor_lists[r][i]`` layout: one list per group rank, each with one
    tensor per input."""
    layout = "output_tensor_lists[r][i] receives rank r's input_tensor_list[i]"
    if not isinstance(outputs, Sequence) or len(outputs) != size:
        lists = f"{len(outputs)} lists" if isinstance(outputs, Sequence) else f"a {type(outputs).__name__}"
        raise InvalidArgument(
            f"rank {rank}: {operation}: output_tensor_lists has {lists} but the group has {size} ranks; "
            f"pass one list per rank ({layout})",
            rank=rank,
            operation=operation,
        )
    for r, outs in enumerate(outputs):
        if not isinstance(outs, Sequence) or len(outs) != len(inputs):
            tensors = f"{len(outs)} tensors" if isinstance(outs, Sequence) else f"a {type(outs).__name__}"
            raise InvalidArgument(
                f"rank {rank}: {operation}: output_tensor_lists[{r}] has {tensors} for {len(inputs)} inputs; "
                f"each rank's list needs one tensor per input ({layout})",
                rank=rank,
                operation=operation,
            )
