"""``NcclGroup``: core's ``Group`` protocol on device tensors, over one ``NcclCommunicator``."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ferrodist.core import Group, InvalidArgument, InvalidRank, ReduceOp, Work, int32

from . import _cuda
from ._buffers import DeviceBuffer, blocks
from ._communicator import NcclCommunicator
from ._config import DEFAULT_TIMEOUT, NcclConfig

__all__ = ["NcclGroup", "init_nccl"]


class NcclGroup:
    """A process group whose collectives run through NCCL on this rank's GPU.

    Blocking calls return once the GPU has finished (bounded by ``timeout``); with
    ``async_op=True`` they return a :class:`~ferrodist.nccl.NcclWork` at once. DDP and the
    pipeline take it wherever they take a CPU ``ProcessGroup``. NCCL matches point-to-point
    messages by order, so ``tag`` is accepted for compatibility and not sent.

    Example::

        group = init_nccl(cpu_group)            # every rank
        x = numba.cuda.to_device(np.full(4, rank + 1.0, np.float32))
        group.all_reduce(x)                     # rank 0: [3, 3, 3, 3]  rank 1: [3, 3, 3, 3]
    """

    def __init__(self, communicator: NcclCommunicator) -> None:
        self._comm = communicator
        self._scratch: int | None = None  # 4 device bytes for barrier()

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    @property
    def global_rank(self) -> int:
        """The rank in the communicator: an NCCL group is the whole of its communicator."""
        return self._comm.rank

    @property
    def communicator(self) -> NcclCommunicator:
        return self._comm

    def abort(self, error: BaseException) -> None:
        """Abort the communicator because of ``error`` (``ncclCommAbort``): this rank's pending
        operations are cancelled, and the other ranks' fail within their deadlines (NCCL has
        no notice to send them). The group is closed afterwards."""
        self._comm.abort()

    def __repr__(self) -> str:
        return f"NcclGroup(rank={self.rank}, size={self.size}, communicator={self._comm!r})"

    def _finish(self, operation: str, async_op: bool, timeout: float | None) -> Work | None:
        work = self._comm.work(operation, timeout=timeout)
        if async_op:
            return work
        work.wait()
        return None

    def _buf(self, x: Any, name: str, operation: str) -> DeviceBuffer:
        return self._comm.buffer(x, name, operation)

    def _blocks(self, x: Any, like: DeviceBuffer, name: str, operation: str) -> list[DeviceBuffer]:
        parts = blocks(x, like.count, self.size, name=name, operation=operation, rank=self.rank)
        checked = [self._buf(p, f"{name}[{i}]", operation) for i, p in enumerate(parts)]
        for i, part in enumerate(checked):
            if part.dtype is not like.dtype:
                raise InvalidArgument(
                    f"rank {self.rank}: {operation}: {name}[{i}] is {part.dtype.name}, expected {like.dtype.name}",
                    rank=self.rank,
                    operation=operation,
                )
        return checked

    def _root(self, root: int, operation: str, what: str) -> int:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.size:
            raise InvalidRank(
                f"rank {self.rank}: {operation}: {what} {root!r} is outside 0..{self.size - 1}",
                rank=self.rank,
                operation=operation,
            )
        return root

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(
        self,
        tensor: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
        compress: str | None = None,
    ) -> Work | None:
        """Reduce ``tensor`` over all ranks, in place on every rank. ``compress`` is not
        offered here (NCCL reduces bfloat16 tensors themselves: cast, reduce, cast back)."""
        if compress is not None:
            raise InvalidArgument(
                f"rank {self.rank}: NcclGroup.all_reduce: compress={compress!r} is not offered; all_reduce a "
                "bfloat16 copy of the tensor, or use ferrodist.collectives' group, whose CUDA route has it"
            )
        self._comm.all_reduce(tensor, None, op)
        return self._finish("all_reduce", async_op, timeout)

    def broadcast(
        self, tensor: Any, src: int = 0, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        self._comm.broadcast(tensor, None, src)
        return self._finish("broadcast", async_op, timeout)

    def reduce(
        self,
        tensor: Any,
        dst: int = 0,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Reduce ``tensor`` over all ranks into rank ``dst``'s ``tensor``."""
        self._comm.reduce(tensor, None, dst, op)
        return self._finish("reduce", async_op, timeout)

    def all_gather(
        self, output: Any, tensor: Any, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
        """Every rank receives every rank's ``tensor``: ``output`` is one array of ``size``
        blocks (one ``ncclAllGather``) or a list of ``size`` arrays (grouped broadcasts)."""
        src = self._buf(tensor, "tensor", "all_gather")
        if isinstance(output, (list, tuple)):
            outs = self._blocks(output, src, "output", "all_gather")
            with self._comm.group():
                for root, out in enumerate(outs):
                    self._comm.broadcast(src if root == self.rank else out, out, root)
        else:
            self._comm.all_gather(src, output)
        return self._finish("all_gather", async_op, timeout)

    def reduce_scatter(
        self,
        output: Any,
        input: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Rank i's ``output`` = the reduction over ranks of their i-th block of ``input``."""
        out = self._buf(output, "output", "reduce_scatter")
        if isinstance(input, (list, tuple)):
            ins = self._blocks(input, out, "input", "reduce_scatter")
            with self._comm.group():
                for root, block in enumerate(ins):
                    self._comm.reduce(block, out if root == self.rank else block, root, op)
        else:
            self._comm.reduce_scatter(input, out, op)
        return self._finish("reduce_scatter", async_op, timeout)

    def gather(
        self,
        tensor: Any,
        gather_list: Any = None,
        dst: int = 0,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Rank ``dst`` receives every rank's ``tensor`` into ``gather_list`` (grouped send/recv)."""
        root = self._root(dst, "gather", "dst")
        src = self._buf(tensor, "tensor", "gather")
        if self.rank == root:
            if gather_list is None:
                raise InvalidArgument(f"rank {root}: gather: the destination rank must pass gather_list")
            outs = self._blocks(gather_list, src, "gather_list", "gather")
            with self._comm.group():
                for peer, out in enumerate(outs):
                    if peer == root:
                        self._comm.copy(out, src)
                    else:
                        self._comm.recv(out, peer)
        else:
            self._comm.send(src, root)
        return self._finish("gather", async_op, timeout)

    def scatter(
        self,
        tensor: Any,
        scatter_list: Any = None,
        src: int = 0,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Rank ``src`` sends block i of ``scatter_list`` to rank i's ``tensor`` (grouped send/recv)."""
        root = self._root(src, "scatter", "src")
        dst = self._buf(tensor, "tensor", "scatter")
        if self.rank == root:
            if scatter_list is None:
                raise InvalidArgument(f"rank {root}: scatter: the source rank must pass scatter_list")
            ins = self._blocks(scatter_list, dst, "scatter_list", "scatter")
            with self._comm.group():
                for peer, block in enumerate(ins):
                    if peer == root:
                        self._comm.copy(dst, block)
                    else:
                        self._comm.send(block, peer)
        else:
            self._comm.recv(dst, root)
        return self._finish("scatter", async_op, timeout)

    def all_to_all(
        self, outputs: Sequence[Any], inputs: Sequence[Any], *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
        """Rank i's ``inputs[j]`` arrives in rank j's ``outputs[i]`` (grouped send/recv).

        ``outputs``/``inputs`` are lists of ``size`` arrays (sizes may differ per pair) or
        single arrays cut into ``size`` equal blocks.
        """
        ins = self._split(inputs, "inputs", "all_to_all")
        outs = self._split(outputs, "outputs", "all_to_all")
        for i, (o, t) in enumerate(zip(outs, ins, strict=True)):
            if o.dtype is not ins[0].dtype or t.dtype is not ins[0].dtype:
                raise InvalidArgument(
                    f"rank {self.rank}: all_to_all: outputs[{i}] / inputs[{i}] mix dtypes; use {ins[0].dtype.name}",
                    rank=self.rank,
                    operation="all_to_all",
                )
        with self._comm.group():
            for peer in range(self.size):
                if peer == self.rank:
                    self._comm.copy(outs[peer], ins[peer])
                else:
                    self._comm.send(ins[peer], peer)
                    self._comm.recv(outs[peer], peer)
        return self._finish("all_to_all", async_op, timeout)

    def _split(self, x: Any, name: str, operation: str) -> list[DeviceBuffer]:
        if isinstance(x, (list, tuple)):
            if len(x) != self.size:
                raise InvalidArgument(
                    f"rank {self.rank}: {operation}: {name} has {len(x)} entries, expected one per rank ({self.size})",
                    rank=self.rank,
                    operation=operation,
                )
            return [self._buf(p, f"{name}[{i}]", operation) for i, p in enumerate(x)]
        whole = self._buf(x, name, operation)
        if whole.count % self.size:
            raise InvalidArgument(
                f"rank {self.rank}: {operation}: {name} has {whole.count} elements, not a multiple of {self.size}",
                rank=self.rank,
                operation=operation,
            )
        step = whole.count // self.size
        return [whole.block(i, step) for i in range(self.size)]

    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Work | None:
        """Return once every rank has reached ``barrier`` (a one-element all_reduce on the GPU)."""
        if self._scratch is None:
            _cuda.set_device(self._comm.device)
            self._scratch = _cuda.malloc(int32.itemsize)
        self._comm.all_reduce(DeviceBuffer(self._scratch, 1, int32))
        return self._finish("barrier", async_op, timeout)

    # -- point to point ----------------------------------------------------------------------
    def _peer(self, peer: int | None, tag: int, operation: str, what: str) -> int:
        if peer is None:
            raise InvalidArgument(
                f"rank {self.rank}: {operation}: NCCL receives from one named rank; pass {what}= (a receive from "
                "any rank runs on a host group: ferrodist.collectives over shm or tcp)"
            )
        rank = self._root(peer, operation, what)
        if rank == self.rank:
            raise InvalidRank(f"rank {self.rank}: {operation}: {what} is this rank itself; copy the data locally")
        if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
            raise InvalidArgument(f"rank {self.rank}: {operation}: tag must be a non-negative integer, not {tag!r}")
        return rank

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to ``dst``; don't modify it until ``wait()`` returns."""
        self._comm.send(tensor, self._peer(dst, tag, "isend", "dst"))
        return self._comm.work("isend")

    def irecv(self, tensor: Any, src: int | None, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from ``src``; read it after ``wait()``."""
        self._comm.recv(tensor, self._peer(src, tag, "irecv", "src"))
        return self._comm.work("irecv")

    def send(self, tensor: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        self._comm.send(tensor, self._peer(dst, tag, "send", "dst"))
        self._finish("send", False, timeout)

    def recv(self, tensor: Any, src: int | None, tag: int = 0, *, timeout: float | None = None) -> int:
        peer = self._peer(src, tag, "recv", "src")
        self._comm.recv(tensor, peer)
        self._finish("recv", False, timeout)
        return peer

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the group's scratch memory and close the communicator."""
        scratch, self._scratch = self._scratch, None
        try:
            self._comm.close()
        finally:
            if scratch is not None:
                _cuda.free(scratch)

    def __enter__(self) -> NcclGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._comm.abort()


def init_nccl(
    cpu_group: Group,
    *,
    device: int | None = None,
    config: NcclConfig | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> NcclGroup:
    """An :class:`NcclGroup` over the ranks of ``cpu_group`` (call on every rank).

    ``device`` defaults to ``$LOCAL_RANK`` (or the rank) modulo the visible GPU count.

    Example::

        cpu = ferrodist.collectives.init_process_group()     # TCP rendezvous
        gpu = init_nccl(cpu)                                  # NCCL on this rank's GPU
    """
    return NcclGroup(NcclCommunicator.from_group(cpu_group, device=device, config=config, timeout=timeout))


if TYPE_CHECKING:  # NcclGroup satisfies core's Group protocol (checked by mypy)
    _protocol_check: type[Group] = NcclGroup
