"""Collectives on CUDA tensors, staged through pinned host memory and the group's CPU collectives.

A ``ProcessGroup`` checks the arguments, fingerprints the call and keeps its deadline;
for CUDA tensors on the staged route it hands this engine (a
``ferrodist.core.DeviceEngine``) the call, the tensors and its CPU route (a
``HostRoute``). all_reduce, broadcast, reduce, all_gather and reduce_scatter copy
the tensor to pinned host buffers, run the CPU collective there (the shared-memory
pipelines, MPI's, or our ring and tree algorithms: whatever a numpy array of that size
would take) and copy the result back:

- a tensor up to ``segment_bytes`` (4 MiB) goes whole: one copy down, one CPU collective,
  one copy up;
- a larger one goes in segments through three host buffers, so that while the CPU
  collective runs on segment k, segment k+1 is being copied down and segment k-1 up.

Copies are raw asynchronous driver copies on the engine's own streams (``_copies``), by
address: no device-array views are made per call. Every rank ends with the same bits, as
the CPU collective gives. gather, scatter, all_to_all and point-to-point stage whole
blocks (every byte there has one source and one destination anyway).

Every call first makes the tensor's device's primary context current in the thread that
runs it (``ferrodist.core.cuda.on_device``): the caller's, a group's async worker, a DDP
hook in an autograd thread. Each such thread has its own streams, events and buffers.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrodist.core import (
    DeviceEngine,
    DeviceMessages,
    DType,
    EngineCall,
    EngineProvider,
    GroupInfo,
    HostMessages,
    HostRoute,
    InvalidArgument,
    Probe,
    ReduceOp,
    Tensor,
    Work,
    bfloat16,
    device_pointer,
    float32,
)
from ferrodist.core import cuda as core_cuda

from . import _copies, _cuda_kernels

__all__ = ["StagedEngine", "StagedProvider", "StagingStats", "engine", "provider"]

#: Default largest segment of a staged collective (``FERRODIST_GPU_SEGMENT_BYTES`` overrides).
SEGMENT_BYTES = 4 << 20
#: Host buffers a pipelined collective rotates through: one being copied down, one in the
#: CPU collective, one being copied up.
SLOTS = 3


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
    return core_cuda.numba_cuda("staged collectives on CUDA tensors")


Step = Callable[[int, int], None]


def parts(n: int, per: int) -> list[tuple[int, int]]:
    """``[start, stop)`` windows of at most ``per`` of ``n`` elements; one (empty) window
    for ``n == 0``, so that every rank still takes part in the call."""
    return [(start, min(n, start + per)) for start in range(0, n, per)] or [(0, 0)]


class StagedEngine:
    """Runs collectives on CUDA tensors through pinned host buffers (a ``DeviceEngine``,
    and the ``DeviceMessages`` of every route).

    ``segment_bytes`` bounds every host buffer of all_reduce, broadcast, reduce,
    all_gather and reduce_scatter (gather, scatter, all_to_all and point-to-point stage
    whole blocks). ``driver`` is the CUDA driver the copies go through: None for
    cuda-python's (the simulator's stand-in under ``NUMBA_ENABLE_CUDASIM=1``), or an object
    with the same functions (tests); a thread uses the one set when it first stages.
    """

    name = "staged"
    direct = False

    def __init__(self, segment_bytes: int = SEGMENT_BYTES, *, driver: Any = None) -> None:
        if segment_bytes < 64:
            raise InvalidArgument(f"segment_bytes={segment_bytes} is too small; use at least 64")
        self.segment_bytes = segment_bytes
        self.stats = StagingStats()
        self.driver = driver
        self._local = threading.local()

    # -- buffers and copies ----------------------------------------------------------------
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

    def _driver(self) -> Any:
        return core_cuda.driver() if self.driver is None else self.driver

    def _on(self, x: Tensor) -> Any:
        """Make ``x``'s device's context current in this thread (``with`` it)."""
        _cuda()  # numba ready (its first initialisation under core's lock)
        return core_cuda.on_device(x.device.index, cu=self._driver())

    def _copies(self) -> _copies.Copies:
        """This thread's streams and events (made on its first staged call, in the context
        made current by the call)."""
        copies: _copies.Copies | None = self._local.__dict__.get("copies")
        if copies is None or copies.driver is not self._driver():
            copies = self._local.copies = _copies.Copies(self._driver(), SLOTS)
        return copies

    def supports(self, dt: DType, op: ReduceOp | None) -> bool:
        """Every dtype and op of the CPU collectives (the host route does the arithmetic)."""
        return True

    def start(self, call: EngineCall) -> None:
        """Nothing to prepare: the engine is one per process, its streams one per thread."""

    def close(self) -> None:
        """Nothing to release per group (buffers and streams belong to threads)."""

    def host_bytes(self) -> int:
        """Bytes of host staging buffers the calling thread holds."""
        pool: dict[tuple[str, int], Any] = self._local.__dict__.get("pool", {})
        return sum(buf.nbytes for (kind, _), buf in pool.items() if kind == "host")

    def _run(self, call: EngineCall, count: int, down: Step | None, work: Step, up: Step | None) -> None:
        """Run ``work(k, slot)`` (the CPU collective on host buffer ``slot``) for parts
        ``k = 0 .. count-1``. ``down(k, slot)`` queues part k's copies into the buffer,
        ``up(k, slot)`` its copies back; either may be None (a rank that only sends or only
        receives). While part k is worked on, part k+1 is copied down and part k-1 up."""
        copies = self._copies()
        rank, deadline = call.ranks[call.rank], call.deadline
        if down is not None:
            down(0, 0)
            copies.downed(0)
        for k in range(count):
            slot = k % SLOTS
            if down is not None and k + 1 < count:
                following = (k + 1) % SLOTS
                if k + 1 >= SLOTS:
                    copies.down_after_up(following)  # its last part is on its way up
                down(k + 1, following)
                copies.downed(following)
            if down is not None:
                copies.wait_down(slot, deadline, rank)
            elif up is not None and k >= SLOTS:
                copies.wait_up(slot, deadline, rank)  # part k - SLOTS left this buffer
            work(k, slot)
            if up is not None:
                up(k, slot)
                copies.upped(slot)
        if up is not None:
            copies.wait_up((count - 1) % SLOTS, deadline, rank)  # one stream: the last covers all

    def _elementwise(
        self, call: EngineCall, base: int, n: int, dt: DType, work: Callable[[Any], None], down: bool, up: bool
    ) -> None:
        """Stage the ``n`` elements at device address ``base`` part by part for a collective
        that works element by element (all_reduce, broadcast, reduce): ``work(host part)``
        runs the CPU collective."""
        itemsize = dt.itemsize
        windows = parts(n, max(1, self.segment_bytes // itemsize))
        width = windows[0][1] - windows[0][0]
        views = [self._host(s, width, dt.numpy) for s in range(min(SLOTS, len(windows)))]
        addresses = [v.ctypes.data for v in views]
        copies = self._copies()

        def to_host(k: int, slot: int) -> None:
            start, stop = windows[k]
            copies.down(addresses[slot], base + start * itemsize, (stop - start) * itemsize)
            self.stats.add(to_host=(stop - start) * itemsize)

        def run(k: int, slot: int) -> None:
            start, stop = windows[k]
            work(views[slot][: stop - start])

        def to_device(k: int, slot: int) -> None:
            start, stop = windows[k]
            copies.up(base + start * itemsize, addresses[slot], (stop - start) * itemsize)
            self.stats.add(to_device=(stop - start) * itemsize)

        self._run(call, len(windows), to_host if down else None, run, to_device if up else None)

    # -- all_reduce, broadcast, reduce -------------------------------------------------------
    def all_reduce(self, call: EngineCall, host: HostRoute, x: Tensor, op: ReduceOp, wire: DType) -> None:
        """all_reduce of ``x``; ``wire=bfloat16`` for a float32 ``x`` reduces a bfloat16
        copy made on the device (half the staged bytes)."""
        if call.size == 1:
            return  # AVG over one rank is the tensor itself
        dt, n = x.dtype, x.numel
        with self._on(x):
            if wire is dt:
                self._elementwise(call, _address(x), n, dt, lambda part: host.all_reduce(part, dt, op), True, True)
                return
            if dt is not float32 or wire is not bfloat16:  # ProcessGroup checked this already
                raise InvalidArgument(f"all_reduce: cannot compress {dt.name} to {wire.name}")
            flat = x.flat()
            bits = self._scratch(1, n, np.dtype(np.uint16))
            _cuda_kernels.cast(bits, bfloat16, flat, float32)
            self._elementwise(
                call,
                device_pointer(bits) if n else 0,
                n,
                bfloat16,
                lambda part: host.all_reduce(part, bfloat16, op),
                True,
                True,
            )
            _cuda_kernels.cast(flat, float32, bits, bfloat16)

    def broadcast(self, call: EngineCall, host: HostRoute, x: Tensor, root: int) -> None:
        mine, dt = call.rank == root, x.dtype
        with self._on(x):
            self._elementwise(
                call, _address(x), x.numel, dt, lambda part: host.broadcast(part, root, dt), mine, not mine
            )

    def reduce(self, call: EngineCall, host: HostRoute, x: Tensor, root: int, op: ReduceOp) -> None:
        """Reduce into the root's ``x``; other ranks' ``x`` is left as it was."""
        mine, dt = call.rank == root, x.dtype
        with self._on(x):
            self._elementwise(call, _address(x), x.numel, dt, lambda part: host.reduce(part, root, dt, op), True, mine)

    # -- all_gather and reduce_scatter -----------------------------------------------------
    def _blocked(
        self,
        call: EngineCall,
        n: int,
        dt: DType,
        gather: bool,
        single: Tensor,
        blocks: Sequence[Tensor],
        work: Callable[..., None],
    ) -> None:
        """Stage a collective between one array of ``n`` elements per rank (``single``) and
        ``size`` blocks of ``n`` (``blocks``): all_gather copies ``single`` down and the
        blocks up, reduce_scatter the other way. Each host buffer holds one part of
        ``single`` then the same part of every block."""
        p = call.size
        itemsize = dt.itemsize
        windows = parts(n, max(1, self.segment_bytes // (itemsize * p)))
        width = windows[0][1] - windows[0][0]
        views = [self._host(s, (p + 1) * width, dt.numpy) for s in range(min(SLOTS, len(windows)))]
        addresses = [v.ctypes.data for v in views]
        base = single.data_ptr() if n else 0
        block_bases = [b.data_ptr() if n else 0 for b in blocks]
        copies = self._copies()

        def one(k: int, slot: int, to_host: bool) -> None:
            start, stop = windows[k]
            nbytes = (stop - start) * itemsize
            if to_host:
                copies.down(addresses[slot], base + start * itemsize, nbytes)
                self.stats.add(to_host=nbytes)
            else:
                copies.up(base + start * itemsize, addresses[slot], nbytes)
                self.stats.add(to_device=nbytes)

        def every(k: int, slot: int, to_host: bool) -> None:
            start, stop = windows[k]
            nbytes = (stop - start) * itemsize
            for j, block in enumerate(block_bases):
                at = addresses[slot] + (1 + j) * nbytes
                if to_host:
                    copies.down(at, block + start * itemsize, nbytes)
                else:
                    copies.up(block + start * itemsize, at, nbytes)
            self.stats.add(**{"to_host" if to_host else "to_device": p * nbytes})

        def run(k: int, slot: int) -> None:
            m = windows[k][1] - windows[k][0]
            view = views[slot]
            work(view[:m], view[m : (p + 1) * m])

        if gather:
            self._run(call, len(windows), lambda k, s: one(k, s, True), run, lambda k, s: every(k, s, False))
        else:
            self._run(call, len(windows), lambda k, s: every(k, s, True), run, lambda k, s: one(k, s, False))

    def all_gather(self, call: EngineCall, host: HostRoute, x: Tensor, blocks: Sequence[Tensor]) -> None:
        dt = x.dtype
        with self._on(x):
            self._blocked(call, x.numel, dt, True, x, blocks, lambda mine, every: host.all_gather(mine, every, dt))

    def reduce_scatter(
        self, call: EngineCall, host: HostRoute, out: Tensor, blocks: Sequence[Tensor], op: ReduceOp
    ) -> None:
        """``out`` = reduction over ranks of their ``blocks[rank]``; ``blocks`` are not modified."""
        dt = out.dtype
        with self._on(out):
            self._blocked(
                call, out.numel, dt, False, out, blocks, lambda mine, every: host.reduce_scatter(mine, every, dt, op)
            )

    # -- whole blocks through Numba's copies --------------------------------------------------
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

    # -- direct: every byte has one source and one destination -----------------------------
    def gather(self, call: EngineCall, x: Tensor, blocks: Sequence[Tensor] | None, root: int) -> None:
        call.agree()
        flat = x.flat()
        with self._on(x):
            if call.rank != root:
                call.send(self._down(flat, self._host(0, flat.shape[0], flat.dtype)), root)
                return
            assert blocks is not None  # the group checked: the root passes them
            n = flat.shape[0]
            staged = self._host(0, n * call.size, flat.dtype)
            peers = [k for k in range(call.size) if k != root]
            call.wait_all([call.irecv(staged[k * n : (k + 1) * n], k) for k in peers])
            for k in peers:
                self._up(staged[k * n : (k + 1) * n], blocks[k].flat())
            if n and blocks[root].data_ptr() != x.data_ptr():
                blocks[root].flat().copy_to_device(flat)

    def scatter(self, call: EngineCall, x: Tensor, blocks: Sequence[Tensor] | None, root: int) -> None:
        call.agree()
        flat = x.flat()
        n = flat.shape[0]
        with self._on(x):
            if call.rank != root:
                staged = self._host(0, n, flat.dtype)
                call.recv(staged, root)
                self._up(staged, flat)
                return
            assert blocks is not None  # the group checked: the root passes them
            staged = self._host(0, n * call.size, flat.dtype)
            peers = [k for k in range(call.size) if k != root]
            sends = [call.isend(self._down(blocks[k].flat(), staged[k * n : (k + 1) * n]), k) for k in peers]
            if n:
                flat.copy_to_device(blocks[root].flat())
            call.wait_all(sends)

    def all_to_all(self, call: EngineCall, outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> None:
        rank, size = call.rank, call.size
        outs, ins = [t.flat() for t in outputs], [t.flat() for t in inputs]
        with self._on(outputs[rank]):
            if outs[rank].shape[0]:
                outs[rank].copy_to_device(ins[rank])
            for step in range(1, size):
                to, frm = (rank + step) % size, (rank - step) % size
                sent = self._down(ins[to], self._host(0, ins[to].shape[0], ins[to].dtype))
                got = self._host(1, outs[frm].shape[0], outs[frm].dtype)
                call.exchange(sent, to, got, frm)
                self._up(got, outs[frm])

    # -- point to point (DeviceMessages) -------------------------------------------------------
    def isend(self, transport: HostMessages, x: Tensor, peer: int, tag: int) -> Work:
        flat = x.flat()
        with self._on(x):
            host = flat.copy_to_host() if flat.shape[0] else np.empty(0, flat.dtype)
        self.stats.add(to_host=host.nbytes)
        return _Staged(transport.isend(host, peer, tag), host, None, self)

    def irecv(self, transport: HostMessages, x: Tensor, peer: int, tag: int) -> Work:
        flat = x.flat()
        host = np.empty(flat.shape[0], flat.dtype)
        return _Staged(transport.irecv(host, peer, tag), host, x, self)


def _address(x: Tensor) -> int:
    """``x``'s device address (0 for an empty tensor, whose array may have none)."""
    return x.data_ptr() if x.numel else 0


class _Staged:
    """A transport request over a host copy; a receive copies to the device when it is
    waited for (in the waiting thread, with the tensor's device's context current)."""

    def __init__(self, request: Work, host: Any, target: Tensor | None, engine: StagedEngine) -> None:
        self._request, self._host, self._target, self._engine = request, host, target, engine
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> None:
        self._request.wait(timeout)
        with self._lock:
            target = self._target
            if target is not None:
                with self._engine._on(target):
                    self._engine._up(self._host, target.flat())
                self._target = None

    def is_completed(self) -> bool:
        return bool(self._request.is_completed())


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


class StagedProvider:
    """The ``staged`` entry of ``ferrodist.device_engines``: one engine per process."""

    name = "staged"
    device_type = "cuda"

    def probe(self) -> Probe:
        """Usable wherever this package is installed (it needs no GPU of its own to take part)."""
        return Probe(True)

    def engine(self, group: GroupInfo) -> StagedEngine:
        return engine()


def provider() -> StagedProvider:
    """What the entry point ``ferrodist.device_engines: staged`` loads."""
    return StagedProvider()


if TYPE_CHECKING:  # the engine and its provider satisfy core's device-engine protocols (checked by mypy)
    _engine_check: type[DeviceEngine] = StagedEngine
    _messages_check: type[DeviceMessages] = StagedEngine
    _provider_check: type[EngineProvider] = StagedProvider
