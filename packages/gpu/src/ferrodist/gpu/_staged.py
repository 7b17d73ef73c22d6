"""Collectives on CUDA tensors, staged through small host buffers and reduced on the GPU.

A ``ProcessGroup`` checks the arguments, fingerprints the call and keeps its deadline;
for CUDA tensors it hands this engine the call and flat device arrays. The engine moves
data in *segments* of at most ``segment_bytes`` per message: a chunk is copied from the
device into a reusable (pinned) host buffer, sent over the group's transport, received
into another host buffer, copied to a device scratch chunk and folded into the tensor
by a device kernel. Only chunks cross PCIe; no host copy of the whole tensor is made
(gather, scatter and all_to_all stage whole blocks: every byte there has one source and
one destination anyway).

Algorithms: ring all_reduce and reduce_scatter, binomial-tree broadcast and reduce, ring
all_gather, direct gather/scatter/all_to_all. Every chunk of an all_reduce is reduced by
one rank and copied to the others, so all ranks end with the same bits.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrodist.core import DType, InvalidArgument, ReduceOp, bfloat16, float32

from . import _cuda_kernels

__all__ = ["StagedEngine", "StagingStats", "engine"]

#: Default largest message of a staged collective (``FERRODIST_GPU_SEGMENT_BYTES`` overrides).
SEGMENT_BYTES = 4 << 20


@dataclass
class StagingStats:
    """What the engine moved across PCIe (bytes) and how big its host buffers grew."""

    to_host: int = 0
    to_device: int = 0
    largest_host_buffer: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, to_host: int = 0, to_device: int = 0) -> None:
        with self.lock:
            self.to_host += to_host
            self.to_device += to_device

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return self.to_host, self.to_device


def _cuda() -> Any:
    from numba import cuda

    return cuda


class _Kernels:
    """The device kernels, one launch at a time under the simulator (its kernel context is
    process-global, so ranks running as threads must not launch concurrently there)."""

    _lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(_cuda_kernels, name)
        from numba import config

        if not config.ENABLE_CUDASIM:  # type: ignore[attr-defined]
            return fn

        def serialised(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return fn(*args, **kwargs)

        return serialised


kernels = _Kernels()


class StagedEngine:
    """Runs collectives on CUDA device arrays through host staging buffers.

    ``segment_bytes`` bounds every staged message and every host buffer (except for
    gather, scatter, all_to_all and point-to-point, which stage whole blocks).
    """

    def __init__(self, segment_bytes: int = SEGMENT_BYTES) -> None:
        if segment_bytes < 64:
            raise InvalidArgument(f"segment_bytes={segment_bytes} is too small; use at least 64")
        self.segment_bytes = segment_bytes
        self.stats = StagingStats()
        self._local = threading.local()

    # -- buffers ---------------------------------------------------------------------------
    def _buffer(self, kind: str, slot: int, count: int, dtype: np.dtype[Any]) -> Any:
        """A per-thread reusable buffer (host: pinned; device: scratch) of ``count`` items."""
        pool: dict[tuple[str, int], Any] = self._local.__dict__.setdefault("pool", {})
        nbytes = max(count * dtype.itemsize, 64)
        buf = pool.get((kind, slot))
        if buf is None or buf.shape[0] < nbytes:
            cuda = _cuda()
            buf = cuda.pinned_array(nbytes, np.uint8) if kind == "host" else cuda.device_array(nbytes, np.uint8)
            pool[(kind, slot)] = buf
            if kind == "host":
                with self.stats.lock:
                    self.stats.largest_host_buffer = max(self.stats.largest_host_buffer, nbytes)
        return buf[: count * dtype.itemsize].view(dtype)

    def _host(self, slot: int, count: int, dtype: np.dtype[Any]) -> Any:
        return self._buffer("host", slot, count, dtype)

    def _scratch(self, slot: int, count: int, dtype: np.dtype[Any]) -> Any:
        return self._buffer("device", slot, count, dtype)

    def _down(self, src: Any, host: Any) -> Any:
        """Copy device ``src`` into the first elements of ``host``; return that view."""
        view = host[: src.shape[0]]
        if view.shape[0]:
            src.copy_to_host(view)
            self.stats.add(to_host=view.nbytes)
        return view

    def _up(self, host: Any, dst: Any) -> None:
        if host.shape[0]:
            dst.copy_to_device(host)
            self.stats.add(to_device=host.nbytes)

    def _chunk(self, itemsize: int, n: int, parts: int = 1) -> int:
        """Elements per staged message: a segment's worth, or less for a small tensor."""
        return max(1, min(self.segment_bytes // itemsize, -(-n // parts)))

    def host_bytes(self) -> int:
        """Bytes of host staging buffers the calling thread holds."""
        pool: dict[tuple[str, int], Any] = self._local.__dict__.get("pool", {})
        return sum(buf.nbytes for (kind, _), buf in pool.items() if kind == "host")

    def _segments(self, n: int, itemsize: int, parts: int) -> list[tuple[int, int]]:
        """Windows of ``x`` whose ``parts`` chunks each fit in one segment."""
        window = max(1, self.segment_bytes // itemsize) * parts
        return [(start, min(n, start + window)) for start in range(0, n, window)]

    # -- all_reduce ------------------------------------------------------------------------
    def all_reduce(self, call: Any, x: Any, dt: DType, op: ReduceOp, divisor: float, wire: DType) -> None:
        """Ring all_reduce of the device array ``x``; ``wire=bfloat16`` for a float32 ``x``
        reduces a bfloat16 copy made on the device (half the staged bytes)."""
        if wire is dt:
            self._ring_all_reduce(call, x, dt, op)
            return
        if dt is not float32 or wire is not bfloat16:  # ProcessGroup checked this already
            raise InvalidArgument(f"all_reduce: cannot compress {dt.name} to {wire.name}")
        bits = self._scratch(1, x.shape[0], np.dtype(np.uint16))
        kernels.cast(bits, bfloat16, x, float32)
        self._ring_all_reduce(call, bits, bfloat16, op)
        kernels.cast(x, float32, bits, bfloat16)

    def _ring_all_reduce(self, call: Any, x: Any, dt: DType, op: ReduceOp) -> None:
        p, r = call.size, call.rank
        if p == 1:
            return  # AVG over one rank is the tensor itself
        right, left = (r + 1) % p, (r - 1) % p
        chunk = self._chunk(dt.itemsize, x.shape[0], p)
        send, recv = self._host(0, chunk, x.dtype), self._host(1, chunk, x.dtype)
        incoming = self._scratch(0, chunk, x.dtype)
        for start, stop in self._segments(x.shape[0], dt.itemsize, p):
            win = x[start:stop]
            bounds = [(stop - start) * i // p for i in range(p + 1)]
            for step in range(p - 1):
                give, take = (r - step) % p, (r - step - 1) % p
                target = win[bounds[take] : bounds[take + 1]]
                got = recv[: target.shape[0]]
                call.exchange(self._down(win[bounds[give] : bounds[give + 1]], send), right, got, left)
                self._up(got, incoming[: got.shape[0]])
                if got.shape[0]:
                    kernels.reduce_into(target, incoming[: got.shape[0]], dt, op)
                    if op is ReduceOp.AVG and step == p - 2:
                        kernels.scale(target, dt, p, divide=True)
            for step in range(p - 1):
                give, take = (r + 1 - step) % p, (r - step) % p
                target = win[bounds[take] : bounds[take + 1]]
                got = recv[: target.shape[0]]
                call.exchange(self._down(win[bounds[give] : bounds[give + 1]], send), right, got, left)
                self._up(got, target)

    # -- broadcast and reduce (binomial tree) ----------------------------------------------
    def broadcast(self, call: Any, x: Any, root: int) -> None:
        call.agree()  # every rank checks that its neighbour names the same root
        parent, children = _tree(call.size, root, call.rank)
        chunk = self._chunk(x.dtype.itemsize, x.shape[0])
        host = self._host(0, chunk, x.dtype)
        for start, stop in self._segments(x.shape[0], x.dtype.itemsize, 1):
            seg = x[start:stop]
            if parent is None:
                staged = self._down(seg, host)
            else:
                staged = host[: stop - start]
                call.recv(staged, parent)
            call.wait_all([call.isend(staged, child) for child in children])
            if parent is not None:
                self._up(staged, seg)

    def reduce(self, call: Any, x: Any, root: int, dt: DType, op: ReduceOp, divisor: float) -> None:
        """Tree reduce into the root's ``x``; other ranks' ``x`` is left as it was."""
        call.agree()
        parent, children = _tree(call.size, root, call.rank)
        chunk = self._chunk(x.dtype.itemsize, x.shape[0])
        host = self._host(0, chunk, x.dtype)
        incoming = self._scratch(0, chunk, x.dtype)
        for start, stop in self._segments(x.shape[0], dt.itemsize, 1):
            seg = x[start:stop]
            acc = seg
            if parent is not None:
                acc = self._scratch(2, chunk, x.dtype)[: stop - start]
                if acc.shape[0]:
                    acc.copy_to_device(seg)
            for child in reversed(children):  # the smallest subtree finishes first
                got = host[: stop - start]
                call.recv(got, child)
                self._up(got, incoming[: got.shape[0]])
                if got.shape[0]:
                    kernels.reduce_into(acc, incoming[: got.shape[0]], dt, op)
            if parent is not None:
                call.send(self._down(acc, host), parent)
            elif op is ReduceOp.AVG and call.size > 1 and acc.shape[0]:
                kernels.scale(acc, dt, call.size, divide=True)

    # -- all_gather and reduce_scatter (ring) ----------------------------------------------
    def all_gather(self, call: Any, x: Any, blocks: Sequence[Any]) -> None:
        p, r = call.size, call.rank
        right, left = (r + 1) % p, (r - 1) % p
        chunk = self._chunk(x.dtype.itemsize, x.shape[0])
        for start, stop in self._segments(x.shape[0], x.dtype.itemsize, 1):
            m = stop - start
            staged = self._host(0, chunk * p, x.dtype)
            parts = [staged[k * chunk : k * chunk + m] for k in range(p)]
            self._down(x[start:stop], parts[r])
            for step in range(p - 1):
                give, take = (r - step) % p, (r - step - 1) % p
                call.exchange(parts[give], right, parts[take], left)
            for k in range(p):
                if k != r:
                    self._up(parts[k], blocks[k][start:stop])
                elif m and blocks[k][start:stop] is not x:
                    blocks[k][start:stop].copy_to_device(x[start:stop])

    def reduce_scatter(
        self, call: Any, out: Any, blocks: Sequence[Any], dt: DType, op: ReduceOp, divisor: float
    ) -> None:
        """``out`` = reduction over ranks of their ``blocks[rank]``; ``blocks`` are not modified."""
        p, r = call.size, call.rank
        right, left = (r + 1) % p, (r - 1) % p
        chunk = self._chunk(out.dtype.itemsize, out.shape[0])
        send, recv = self._host(0, chunk, out.dtype), self._host(1, chunk, out.dtype)
        incoming = self._scratch(0, chunk, out.dtype)
        partial = self._scratch(1, chunk, out.dtype)
        for start, stop in self._segments(out.shape[0], dt.itemsize, 1):
            m = stop - start
            if p == 1:
                out[start:stop].copy_to_device(blocks[0][start:stop])
                continue
            outgoing = self._down(blocks[(r - 1) % p][start:stop], send)
            for step in range(p - 1):
                last = step == p - 2
                call.exchange(outgoing, right, recv[:m], left)
                self._up(recv[:m], incoming[:m])
                target = out[start:stop] if last else partial[:m]
                target.copy_to_device(blocks[(r - step - 2) % p][start:stop])
                kernels.reduce_into(target, incoming[:m], dt, op)
                if last and op is ReduceOp.AVG:
                    kernels.scale(target, dt, p, divide=True)
                if not last:
                    outgoing = self._down(target, send)

    # -- direct: every byte has one source and one destination -----------------------------
    def gather(self, call: Any, x: Any, blocks: Sequence[Any] | None, root: int) -> None:
        call.agree()
        if call.rank != root:
            call.send(self._down(x, self._host(0, x.shape[0], x.dtype)), root)
            return
        assert blocks is not None
        n = x.shape[0]
        staged = self._host(0, n * call.size, x.dtype)
        peers = [k for k in range(call.size) if k != root]
        call.wait_all([call.irecv(staged[k * n : (k + 1) * n], k) for k in peers])
        for k in peers:
            self._up(staged[k * n : (k + 1) * n], blocks[k])
        if n and blocks[root] is not x:
            blocks[root].copy_to_device(x)

    def scatter(self, call: Any, x: Any, blocks: Sequence[Any] | None, root: int) -> None:
        call.agree()
        n = x.shape[0]
        if call.rank != root:
            staged = self._host(0, n, x.dtype)
            call.recv(staged, root)
            self._up(staged, x)
            return
        assert blocks is not None
        staged = self._host(0, n * call.size, x.dtype)
        peers = [k for k in range(call.size) if k != root]
        sends = [call.isend(self._down(blocks[k], staged[k * n : (k + 1) * n]), k) for k in peers]
        if n:
            x.copy_to_device(blocks[root])
        call.wait_all(sends)

    def all_to_all(self, call: Any, outputs: Sequence[Any], inputs: Sequence[Any]) -> None:
        rank, size = call.rank, call.size
        if outputs[rank].shape[0]:
            outputs[rank].copy_to_device(inputs[rank])
        for step in range(1, size):
            to, frm = (rank + step) % size, (rank - step) % size
            sent = self._down(inputs[to], self._host(0, inputs[to].shape[0], inputs[to].dtype))
            got = self._host(1, outputs[frm].shape[0], outputs[frm].dtype)
            call.exchange(sent, to, got, frm)
            self._up(got, outputs[frm])

    # -- point to point ----------------------------------------------------------------------
    def isend(self, transport: Any, x: Any, peer: int, tag: int) -> Any:
        host = x.copy_to_host() if x.shape[0] else np.empty(0, x.dtype)
        self.stats.add(to_host=host.nbytes)
        return _Staged(transport.isend(host, peer, tag), host, None, self)

    def irecv(self, transport: Any, x: Any, peer: int, tag: int) -> Any:
        host = np.empty(x.shape[0], x.dtype)
        return _Staged(transport.irecv(host, peer, tag), host, x, self)


class _Staged:
    """A transport request over a host copy; a receive copies to the device when it is waited for."""

    def __init__(self, request: Any, host: Any, target: Any, engine: StagedEngine) -> None:
        self._request, self._host, self._target, self._engine = request, host, target, engine
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> None:
        self._request.wait(timeout)
        with self._lock:
            if self._target is not None:
                self._engine._up(self._host, self._target)
                self._target = None

    def is_completed(self) -> bool:
        return bool(self._request.is_completed())


def _tree(size: int, root: int, rank: int) -> tuple[int | None, list[int]]:
    """Binomial tree rooted at ``root``: ``(parent, children)``, children largest subtree first."""
    v = (rank - root) % size
    low = v & -v if v else 1 << size.bit_length()
    parent = None if v == 0 else ((v - low) + root) % size
    children = []
    step = 1
    while step < low and v + step < size:
        children.append((v + step + root) % size)
        step <<= 1
    return parent, children[::-1]


@functools.cache
def engine() -> StagedEngine:
    """This process's engine for CUDA tensors (what collectives find by entry point).
    ``FERRODIST_GPU_SEGMENT_BYTES`` sets its segment size (default 4 MiB)."""
    raw = os.environ.get("FERRODIST_GPU_SEGMENT_BYTES", str(SEGMENT_BYTES))
    try:
        size = int(raw)
    except ValueError:
        raise InvalidArgument(f"FERRODIST_GPU_SEGMENT_BYTES={raw!r} is not a number of bytes") from None
    return StagedEngine(size)
