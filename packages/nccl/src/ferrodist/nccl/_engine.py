"""The NCCL engine: a group's collectives on CUDA tensors, device to device through NCCL,
with ferrodist's promises kept on that route too.

A ``ProcessGroup`` whose ranks all have a GPU of their own and NCCL chooses this engine
(``ferrodist.collectives``; the entry point ``ferrodist.device_engines: nccl``). Each call:

1. is fingerprinted over the group's CPU channel first (``call.agree()``): ranks making
   different calls raise ``CollectiveMismatch`` on every rank instead of hanging in NCCL;
2. is enqueued on the communicator's stream (a blocking stream: it runs after the work
   the caller queued on the legacy default stream, and later work there waits for it);
3. is waited for until done, within the call's deadline, while NCCL's asynchronous error
   state and the group's abort notices are polled. A timeout, an NCCL error or a peer's
   failure aborts the communicator and fails the call; the group then aborts on every rank
   and names the rank that caused it.

The communicator is made in the group's route-setup call (:meth:`NcclEngine.start`):
rank 0's unique id travels over the CPU channel, and a non-blocking ``ncclCommInitRank``
is polled against the same deadline. Reductions NCCL lacks (the bitwise ops) are declared
unsupported, and the group sends those calls through the staged engine on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ferrodist.core import (
    CollectiveTimeout,
    DeviceEngine,
    DType,
    EngineCall,
    EngineProvider,
    FerrodistError,
    GroupInfo,
    HostRoute,
    InvalidArgument,
    Probe,
    ReduceOp,
    Tensor,
    bfloat16,
    device_cast,
    float32,
)
from ferrodist.core import cuda as core_cuda

from ._buffers import DeviceBuffer, nccl_op
from ._communicator import NcclCommunicator
from ._config import NcclConfig
from ._ids import get_unique_id
from ._library import UNIQUE_ID_BYTES, load_library, version_code

__all__ = ["NcclEngine", "NcclProvider", "provider"]

_FIRST_NAP, _LONGEST_NAP = 1e-5, 1e-3


class Communicator(Protocol):
    """What the engine uses of a communicator (``NcclCommunicator``; tests pass stand-ins)."""

    @property
    def device(self) -> int: ...

    def buffer(self, x: object, name: str, operation: str) -> DeviceBuffer: ...

    def all_reduce(self, sendbuf: Any, recvbuf: Any = None, op: ReduceOp | str = ReduceOp.SUM) -> None: ...

    def broadcast(self, sendbuf: Any, recvbuf: Any = None, root: int = 0) -> None: ...

    def reduce(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, op: ReduceOp | str = ReduceOp.SUM) -> None: ...

    def all_gather(self, sendbuf: Any, recvbuf: Any) -> None: ...

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: ReduceOp | str = ReduceOp.SUM) -> None: ...

    def send(self, buf: Any, peer: int) -> None: ...

    def recv(self, buf: Any, peer: int) -> None: ...

    def copy(self, dst: Any, src: Any) -> None: ...

    def group(self) -> contextlib.AbstractContextManager[None]: ...

    def mark(self) -> Any: ...

    def finished(self, mark: Any) -> bool: ...

    def forget(self, mark: Any) -> None: ...

    def check_async_error(self) -> None: ...

    def abort(self) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


#: ``(rank, size, unique_id, device, timeout) -> communicator``.
Factory = Callable[[int, int, bytes, int, float], Communicator]


def _communicator(rank: int, size: int, unique_id: bytes, device: int, timeout: float) -> Communicator:
    return NcclCommunicator(rank, size, unique_id, device=device, config=NcclConfig(blocking=False), timeout=timeout)


class NcclEngine:
    """One group's collectives on CUDA tensors through one NCCL communicator.

    Args:
        group: the group it serves.
        device: the GPU of this rank (the one its probe found).
        factory: makes the communicator (tests pass a stand-in).
        unique_id: makes rank 0's ``ncclUniqueId``.
    """

    name = "nccl"
    direct = True

    def __init__(
        self,
        group: GroupInfo,
        device: int,
        *,
        factory: Factory = _communicator,
        unique_id: Callable[[], bytes] = get_unique_id,
    ) -> None:
        self._group = group
        self._device = device
        self._factory = factory
        self._unique_id = unique_id
        self._comm: Communicator | None = None
        self._scratch: Any = None  # device bits of a compressed all_reduce, grown as needed

    def __repr__(self) -> str:
        return f"NcclEngine(group={self._group.name!r}, rank={self._group.rank}, cuda:{self._device})"

    @property
    def communicator(self) -> Communicator | None:
        return self._comm

    # -- lifetime ------------------------------------------------------------------------------
    def start(self, call: EngineCall) -> None:
        """Make the communicator: rank 0's unique id to every rank over the CPU channel,
        then a non-blocking init polled until ``call.deadline``."""
        uid = np.zeros(UNIQUE_ID_BYTES, np.uint8)
        if call.rank == 0:
            uid[:] = np.frombuffer(self._unique_id(), np.uint8)
            call.wait_all([call.isend(uid, peer) for peer in range(1, call.size)])
        else:
            call.recv(uid, 0)
        with self._on():
            self._comm = self._factory(call.rank, call.size, uid.tobytes(), self._device, call.remaining())

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            with self._on(), contextlib.suppress(FerrodistError):
                comm.close(timeout=10.0)

    def supports(self, dt: DType, op: ReduceOp | None) -> bool:
        """NCCL moves every dtype ferrodist has but reduces with SUM, PRODUCT, MIN, MAX and
        AVG only (and has no uint16/uint32/uint64/int16 reductions)."""
        if dt.nccl is None:
            return False
        if op is None:
            return True
        try:
            nccl_op(op, dt, operation="supports")
        except InvalidArgument:
            return False
        return True

    # -- the calls -------------------------------------------------------------------------------
    def all_reduce(self, call: EngineCall, host: HostRoute, x: Tensor, op: ReduceOp, wire: DType) -> None:
        with self._run(call, "all_reduce") as comm:
            if wire is x.dtype:
                comm.all_reduce(comm.buffer(x, "tensor", "all_reduce"), None, op)
                self._wait(call, comm, "all_reduce")
                return
            if x.dtype is not float32 or wire is not bfloat16:
                raise InvalidArgument(f"all_reduce: cannot compress {x.dtype.name} to {wire.name}")
            cast = _cast()
            bits = self._bits(x.numel)
            cast(bits, bfloat16, x.flat(), float32)
            packed = Tensor.from_device_array(bits, dtype=bfloat16)
            comm.all_reduce(comm.buffer(packed, "tensor (bfloat16)", "all_reduce"), None, op)
            self._wait(call, comm, "all_reduce")
            cast(x.flat(), float32, bits, bfloat16)

    def broadcast(self, call: EngineCall, host: HostRoute, x: Tensor, root: int) -> None:
        with self._run(call, "broadcast") as comm:
            comm.broadcast(comm.buffer(x, "tensor", "broadcast"), None, root)
            self._wait(call, comm, "broadcast")

    def reduce(self, call: EngineCall, host: HostRoute, x: Tensor, root: int, op: ReduceOp) -> None:
        """Reduce into ``root``'s ``x``; the other ranks' ``x`` stays as it was (NCCL writes
        its result to the root only)."""
        with self._run(call, "reduce") as comm:
            comm.reduce(comm.buffer(x, "tensor", "reduce"), None, root, op)
            self._wait(call, comm, "reduce")

    def all_gather(self, call: EngineCall, host: HostRoute, x: Tensor, blocks: Sequence[Tensor]) -> None:
        with self._run(call, "all_gather") as comm:
            src = comm.buffer(x, "tensor", "all_gather")
            outs = [comm.buffer(b, f"output[{i}]", "all_gather") for i, b in enumerate(blocks)]
            whole = _consecutive(outs)
            if whole is not None:
                comm.all_gather(src, whole)
            else:
                with comm.group():
                    for root, out in enumerate(outs):
                        comm.broadcast(src if root == call.rank else out, out, root)
            self._wait(call, comm, "all_gather")

    def reduce_scatter(
        self, call: EngineCall, host: HostRoute, out: Tensor, blocks: Sequence[Tensor], op: ReduceOp
    ) -> None:
        with self._run(call, "reduce_scatter") as comm:
            target = comm.buffer(out, "output", "reduce_scatter")
            ins = [comm.buffer(b, f"input[{i}]", "reduce_scatter") for i, b in enumerate(blocks)]
            whole = _consecutive(ins)
            if whole is not None:
                comm.reduce_scatter(whole, target, op)
            else:
                with comm.group():
                    for root, block in enumerate(ins):
                        comm.reduce(block, target if root == call.rank else block, root, op)
            self._wait(call, comm, "reduce_scatter")

    def gather(self, call: EngineCall, x: Tensor, blocks: Sequence[Tensor] | None, root: int) -> None:
        with self._run(call, "gather") as comm:
            src = comm.buffer(x, "tensor", "gather")
            with comm.group():
                if call.rank != root:
                    comm.send(src, root)
                else:
                    assert blocks is not None  # the group checked: the root passes them
                    for peer, block in enumerate(blocks):
                        out = comm.buffer(block, f"gather_list[{peer}]", "gather")
                        comm.copy(out, src) if peer == root else comm.recv(out, peer)
            self._wait(call, comm, "gather")

    def scatter(self, call: EngineCall, x: Tensor, blocks: Sequence[Tensor] | None, root: int) -> None:
        with self._run(call, "scatter") as comm:
            dst = comm.buffer(x, "tensor", "scatter")
            with comm.group():
                if call.rank != root:
                    comm.recv(dst, root)
                else:
                    assert blocks is not None  # the group checked: the root passes them
                    for peer, block in enumerate(blocks):
                        src = comm.buffer(block, f"scatter_list[{peer}]", "scatter")
                        comm.copy(dst, src) if peer == root else comm.send(src, peer)
            self._wait(call, comm, "scatter")

    def all_to_all(self, call: EngineCall, outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> None:
        with self._run(call, "all_to_all") as comm:
            outs = [comm.buffer(t, f"outputs[{i}]", "all_to_all") for i, t in enumerate(outputs)]
            ins = [comm.buffer(t, f"inputs[{i}]", "all_to_all") for i, t in enumerate(inputs)]
            with comm.group():
                for peer in range(call.size):
                    if peer == call.rank:
                        comm.copy(outs[peer], ins[peer])
                    else:
                        if ins[peer].count:
                            comm.send(ins[peer], peer)
                        if outs[peer].count:
                            comm.recv(outs[peer], peer)
            self._wait(call, comm, "all_to_all")

    # -- plumbing ----------------------------------------------------------------------------
    def _on(self) -> Any:
        core_cuda.numba_cuda("the NCCL engine")  # numba's driver ready (the casts use it)
        return core_cuda.on_device(self._device)

    @contextlib.contextmanager
    def _run(self, call: EngineCall, operation: str) -> Iterator[Communicator]:
        """Check that every rank is in this call, then hand over the communicator with
        this rank's GPU context current."""
        comm = self._comm
        if comm is None:
            raise FerrodistError(
                f"rank {call.ranks[call.rank]}: {operation}: the NCCL communicator of group {self._group.name} "
                "is closed (the group failed or was destroyed); make a new group",
                rank=call.ranks[call.rank],
                operation=operation,
            )
        call.agree()  # a rank in another call fails here, over the CPU channel, before NCCL sees anything
        with self._on():
            yield comm

    def _wait(self, call: EngineCall, comm: Communicator, operation: str) -> None:
        """Return once the work enqueued so far is done; on a deadline, an NCCL error or a
        peer's abort, abort the communicator and raise."""
        me = call.ranks[call.rank]
        mark = comm.mark()
        nap = _FIRST_NAP
        try:
            while not comm.finished(mark):
                try:
                    comm.check_async_error()  # raises (and aborts) on NCCL's asynchronous errors
                except FerrodistError as exc:
                    self._comm = None
                    raise exc.with_context(f"rank {me}: {operation} through NCCL") from None
                aborted = call.aborted()
                if aborted is not None:
                    self._abort()
                    raise aborted
                if time.monotonic() >= call.deadline:
                    self._abort()
                    raise CollectiveTimeout(
                        f"rank {me}: {operation} through NCCL on cuda:{self._device} did not finish before the "
                        "call's deadline; the NCCL communicator was aborted (a peer is missing, stuck, or slow: "
                        "raise the timeout if it is only slow)",
                        rank=me,
                        operation=operation,
                    )
                time.sleep(nap)
                nap = min(nap * 2, _LONGEST_NAP)
        finally:
            with contextlib.suppress(FerrodistError):
                comm.forget(mark)

    def _abort(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def _bits(self, count: int) -> Any:
        """A device array of at least ``count`` uint16 (the bfloat16 copy of a compressed call)."""
        if self._scratch is None or self._scratch.shape[0] < count:
            self._scratch = core_cuda.numba_cuda("a compressed all_reduce").device_array(max(count, 1), np.uint16)
        return self._scratch[:count]


def _consecutive(buffers: Sequence[DeviceBuffer]) -> DeviceBuffer | None:
    """The buffers as one, when each starts where the one before ends (one tensor cut into
    per-rank blocks): NCCL then moves it in a single call."""
    first = buffers[0]
    for i, buf in enumerate(buffers):
        if buf.dtype is not first.dtype or buf.count != first.count or buf.ptr != first.ptr + i * first.nbytes:
            return None
    return DeviceBuffer(first.ptr, first.count * len(buffers), first.dtype, first.device)


def _cast() -> Callable[..., None]:
    return device_cast("cuda", "all_reduce(compress='bf16') on the NCCL route")


# ---------------------------------------------------------------------------------------
# The provider: can this process run NCCL, and with which GPU
# ---------------------------------------------------------------------------------------


def _gpu_device_files() -> bool:
    """False on Linux when no NVIDIA device node exists (no GPU: nothing more to look at)."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"))


def _identity(index: int) -> bytes:
    """The GPU's UUID (16 bytes), else the host name and its PCI bus id."""
    cu = core_cuda.driver()
    device = core_cuda.check(cu.cuDeviceGet(index), f"cuDeviceGet({index})")
    for name in ("cuDeviceGetUuid_v2", "cuDeviceGetUuid"):
        function = getattr(cu, name, None)
        if function is not None:
            uuid = core_cuda.check(function(device), name)
            raw = bytes(getattr(uuid, "bytes", b""))
            if raw:
                return raw[:16]
    bus = core_cuda.check(cu.cuDeviceGetPCIBusId(32, device), "cuDeviceGetPCIBusId")
    text = bus.decode(errors="replace") if isinstance(bus, bytes) else str(bus)
    return f"{socket.gethostname()}:{text.strip(chr(0))}".encode()[:32]


@functools.cache
def _probe() -> tuple[Probe, int]:
    """(what this process can do, the GPU index it would use); once per process."""
    if core_cuda.simulated():
        return Probe(False, "Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) has no NCCL"), 0
    if not _gpu_device_files():
        return Probe(False, "no NVIDIA GPU here (no /dev/nvidiactl)"), 0
    try:
        from ._cuda import require_device

        library = load_library()
        index = require_device(None, "the NCCL route")
        with core_cuda.on_device(index):
            identity = _identity(index)
        return Probe(True, device=identity, version=version_code(*library.version)), index
    except FerrodistError as exc:
        return Probe(False, exc.message), 0
    except Exception as exc:  # a broken CUDA install must not stop the group: it takes the staged route
        return Probe(False, f"{type(exc).__name__}: {exc}"), 0


class NcclProvider:
    """The ``nccl`` entry of ``ferrodist.device_engines``."""

    name = "nccl"
    device_type = "cuda"

    def probe(self) -> Probe:
        """NCCL loads and this rank's GPU (``$LOCAL_RANK`` modulo the GPUs it sees) works;
        the GPU's UUID tells ranks sharing one apart."""
        return _probe()[0]

    def engine(self, group: GroupInfo) -> NcclEngine:
        return NcclEngine(group, _probe()[1])


def provider() -> NcclProvider:
    """What the entry point ``ferrodist.device_engines: nccl`` loads."""
    return NcclProvider()


if TYPE_CHECKING:  # the engine and its provider satisfy core's device-engine protocols (checked by mypy)
    _engine_check: type[DeviceEngine] = NcclEngine
    _provider_check: type[EngineProvider] = NcclProvider
    _communicator_check: type[Communicator] = NcclCommunicator
