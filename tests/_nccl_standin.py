"""A stand-in for NCCL under Numba's CUDA simulator, for testing the NCCL route without GPUs.

``Fabric`` is the "network" of one simulated world: each rank's ``StandInComm`` queues what
the NCCL engine enqueues, and the fabric runs a rank's queue as far as it can whenever a
rank polls (``finished``): a collective runs once every rank has queued the same one, a
receive once its send was queued. Simulated device pointers are host addresses, so the
data is moved and reduced with numpy. Failures are injected per rank: ``stall`` (its
queue never runs: a GPU that hangs or a peer that left NCCL), ``async_error`` (NCCL's
asynchronous error state), ``refuse_init`` (ncclCommInitRank fails).

``StandInProvider`` is what ``ferrodist.collectives`` finds as the ``nccl`` engine: every
rank of the world can run it (each with GPU ``gpu-<rank>`` unless told to share one).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import FerrodistError, GroupInfo, Probe, ReduceOp, as_tensor
from ferrodist.nccl._buffers import DeviceBuffer
from ferrodist.nccl._engine import NcclEngine

UID = bytes(range(1, 129))
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")


def view(buf: DeviceBuffer) -> np.ndarray:
    """The memory of a simulated device buffer as a numpy array of its dtype."""
    if buf.count == 0:
        return np.empty(0, buf.dtype.numpy)
    raw = (ctypes.c_byte * buf.nbytes).from_address(buf.ptr)
    return np.frombuffer(raw, dtype=buf.dtype.numpy)


def _reduce(arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    kind = arrays[0].dtype
    wide = np.float32 if kind in (np.float16, np.dtype(ml_dtypes.bfloat16)) else kind
    stack = np.stack([a.astype(wide) for a in arrays])
    if kind == np.bool_:
        out = stack.any(0) if op in (ReduceOp.SUM, ReduceOp.MAX) else stack.all(0)
    elif op is ReduceOp.AVG:
        out = stack.sum(0) / len(arrays)
    else:
        ufunc = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum}.get(op, np.maximum)
        out = ufunc.reduce(stack, axis=0)
    return np.asarray(out).astype(kind)


class Fabric:
    """The stand-in NCCL of one world of ``size`` ranks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.RLock()
        self.queues: list[list[tuple[Any, ...]]] = [[] for _ in range(size)]
        self.ran = [0] * size  # operations run, per rank
        self.mail: dict[tuple[int, int], list[np.ndarray]] = {}
        self.comms: dict[int, StandInComm] = {}
        self.uids: dict[int, bytes] = {}
        self.stall: set[int] = set()
        self.async_error: set[int] = set()
        self.refuse_init: set[int] = set()
        self.enqueued = 0  # operations queued by every rank together

    def communicator(self, rank: int, size: int, unique_id: bytes, device: int, timeout: float) -> StandInComm:
        if rank in self.refuse_init:
            raise FerrodistError(f"rank {rank}: ncclCommInitRank failed: ncclUnhandledCudaError (stand-in)", rank=rank)
        with self.lock:
            self.uids[rank] = unique_id
            comm = self.comms[rank] = StandInComm(self, rank, size)
        return comm

    def queue(self, rank: int, op: tuple[Any, ...]) -> None:
        with self.lock:
            self.queues[rank].append(op)
            self.enqueued += 1

    # -- running the queues ------------------------------------------------------------------
    def progress(self) -> None:
        with self.lock:
            moved = True
            while moved:
                moved = False
                for rank in range(self.size):
                    while self._step(rank):
                        moved = True

    def _head(self, rank: int) -> tuple[Any, ...] | None:
        if rank in self.stall or self.ran[rank] >= len(self.queues[rank]):
            return None
        return self.queues[rank][self.ran[rank]]

    def _step(self, rank: int) -> bool:
        op = self._head(rank)
        if op is None:
            return False
        kind = op[0]
        if kind == "send":
            _, buf, peer = op
            self.mail.setdefault((rank, peer), []).append(view(buf).copy())
        elif kind == "recv":
            _, buf, peer = op
            box = self.mail.get((peer, rank))
            if not box:
                return False
            view(buf)[...] = box.pop(0)
        elif kind == "copy":
            _, dst, src = op
            view(dst)[...] = view(src)
        else:
            heads = [self._head(r) for r in range(self.size)]
            if any(h is None or h[0] != kind for h in heads):
                return False
            self._collective(kind, heads)
            for r in range(self.size):
                self.ran[r] += 1
            return True
        self.ran[rank] += 1
        return True

    def _collective(self, kind: str, ops: list[tuple[Any, ...]]) -> None:
        if kind == "all_reduce":
            result = _reduce([view(op[1]).copy() for op in ops], ops[0][3])
            for op in ops:
                view(op[2])[...] = result
        elif kind == "broadcast":
            root = ops[0][3]
            data = view(ops[root][1]).copy()
            for op in ops:
                view(op[2])[...] = data
        elif kind == "reduce":
            root = ops[0][3]
            view(ops[root][2])[...] = _reduce([view(op[1]).copy() for op in ops], ops[0][4])
        elif kind == "all_gather":
            data = np.concatenate([view(op[1]).copy() for op in ops])
            for op in ops:
                view(op[2])[...] = data
        elif kind == "reduce_scatter":
            n = ops[0][2].count
            total = _reduce([view(op[1]).copy() for op in ops], ops[0][3])
            for r, op in enumerate(ops):
                view(op[2])[...] = total[r * n : (r + 1) * n]


class StandInComm:
    """What the NCCL engine uses of a communicator, over a :class:`Fabric`."""

    device = 0

    def __init__(self, fabric: Fabric, rank: int, size: int) -> None:
        self.fabric, self.rank, self.size = fabric, rank, size
        self.aborted = False
        self.closed = False

    def buffer(self, x: object, name: str, operation: str) -> DeviceBuffer:
        if isinstance(x, DeviceBuffer):
            return x
        t = as_tensor(x)
        return DeviceBuffer(t.data_ptr(), t.numel, t.dtype)

    def _queue(self, *op: Any) -> None:
        if self.aborted or self.closed:
            raise FerrodistError(f"rank {self.rank}: {op[0]} on an aborted stand-in communicator")
        self.fabric.queue(self.rank, op)

    def all_reduce(self, sendbuf: Any, recvbuf: Any = None, op: Any = ReduceOp.SUM) -> None:
        self._queue("all_reduce", sendbuf, recvbuf or sendbuf, ReduceOp.coerce(op))

    def broadcast(self, sendbuf: Any, recvbuf: Any = None, root: int = 0) -> None:
        self._queue("broadcast", sendbuf, recvbuf or sendbuf, root)

    def reduce(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, op: Any = ReduceOp.SUM) -> None:
        self._queue("reduce", sendbuf, recvbuf or sendbuf, root, ReduceOp.coerce(op))

    def all_gather(self, sendbuf: Any, recvbuf: Any) -> None:
        self._queue("all_gather", sendbuf, recvbuf)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = ReduceOp.SUM) -> None:
        self._queue("reduce_scatter", sendbuf, recvbuf, ReduceOp.coerce(op))

    def send(self, buf: Any, peer: int) -> None:
        self._queue("send", buf, peer)

    def recv(self, buf: Any, peer: int) -> None:
        self._queue("recv", buf, peer)

    def copy(self, dst: Any, src: Any) -> None:
        self._queue("copy", dst, src)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        yield

    def mark(self) -> int:
        with self.fabric.lock:
            return len(self.fabric.queues[self.rank])

    def finished(self, mark: int) -> bool:
        self.fabric.progress()
        return self.fabric.ran[self.rank] >= mark

    def forget(self, mark: int) -> None:
        pass

    def check_async_error(self) -> None:
        if self.rank in self.fabric.async_error:
            self.abort()
            raise FerrodistError(
                f"rank {self.rank}: NCCL reported an asynchronous error: ncclRemoteError (stand-in)", rank=self.rank
            )

    def abort(self) -> None:
        self.aborted = True

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


class StandInProvider:
    """The ``nccl`` engine provider over a :class:`Fabric`."""

    name = "nccl"
    device_type = "cuda"

    def __init__(self, fabric: Fabric, *, shared_gpu: bool = False, usable: set[int] | None = None) -> None:
        self.fabric = fabric
        self.shared_gpu = shared_gpu
        self.usable = usable  # ranks that can run NCCL (None: all)

    def probe(self) -> Probe:
        rank = dist.get_rank()
        if self.usable is not None and rank not in self.usable:
            return Probe(False, f"no GPU on rank {rank} (stand-in)")
        return Probe(True, device=b"gpu-0" if self.shared_gpu else f"gpu-{rank}".encode(), version=22809)

    def engine(self, group: GroupInfo) -> NcclEngine:
        return NcclEngine(group, 0, factory=self.fabric.communicator, unique_id=lambda: UID)


def use_standin(monkeypatch: Any, fabric: Fabric, **options: Any) -> StandInProvider:
    """Make the groups made from now on find the stand-in as their ``nccl`` engine."""
    from ferrodist.collectives import _device

    real = _device.providers()
    standin = StandInProvider(fabric, **options)
    monkeypatch.setattr(_device, "providers", lambda: {"staged": real["staged"], "nccl": standin})
    return standin
