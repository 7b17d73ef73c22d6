"""``NcclCommunicator``: one ``ncclComm_t`` with its GPU and stream, every wait bounded."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import numpy as np

from ferrodist.core import (
    CollectiveTimeout,
    DeviceUnavailable,
    FerrodistError,
    Group,
    InvalidArgument,
    InvalidRank,
    ReduceOp,
)

from . import _cuda
from ._buffers import DeviceBuffer, device_buffer, nccl_datatype, nccl_op
from ._config import DEFAULT_TIMEOUT, NcclConfig, check_timeout, check_world
from ._ids import get_unique_id
from ._library import UNIQUE_ID_BYTES, Result, UniqueIdStruct, load_library
from ._status import check, error_for
from ._work import NcclWork

__all__ = ["NcclCommunicator"]

_PENDING = (Result.ncclSuccess, Result.ncclInProgress)


class NcclCommunicator:
    """An NCCL communicator of ``size`` ranks on one GPU of this process, with its own stream.

    The collective methods *enqueue* work on the stream (or on ``stream=``) and return;
    :meth:`synchronize` or a :meth:`work` handle waits for it, polling the stream and NCCL's
    asynchronous error state, and aborts the communicator and raises ``CollectiveTimeout``
    when the timeout passes, so a missing rank never hangs the caller. Buffers are CUDA
    arrays (Numba, CuPy, PyTorch, anything with ``__cuda_array_interface__``).

    Example::

        uid = get_unique_id() if rank == 0 else received_from_rank_0   # 128 bytes
        with NcclCommunicator(rank, size, uid) as comm:
            comm.all_reduce(x)           # x: a CUDA array, reduced in place
            comm.synchronize()           # rank 0: sum over ranks; rank 1: the same

    Raises (at creation):
        DeviceUnavailable: no usable GPU (checked with ``cudaGetDeviceCount`` first).
        BackendUnavailable: the NCCL library or cuda-python is missing.
        CollectiveTimeout: not every rank joined within ``timeout`` seconds.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        unique_id: bytes,
        *,
        device: int | None = None,
        config: NcclConfig | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        uid = check_world(rank, size, unique_id)
        self._rank, self._size = rank, size
        self._timeout = check_timeout(timeout, DEFAULT_TIMEOUT, "NcclCommunicator")
        self._config = config if config is not None else NcclConfig()
        self._comm: int | None = None
        self._stream: int | None = None
        self._closed = False
        self._lib = load_library()
        self._device = _cuda.require_device(device, "NcclCommunicator", rank=rank)
        _cuda.set_device(self._device)
        self._stream = _cuda.create_stream()
        try:
            self._init(uid)
        except BaseException:
            self._release(abort=True)
            raise

    def _init(self, uid: bytes) -> None:
        handle = ctypes.c_void_p()
        unique = UniqueIdStruct.from_buffer_copy(uid)
        deadline = time.monotonic() + self._timeout
        if self._lib.has("ncclCommInitRankConfig"):
            config = self._config.to_struct(self._lib.version)
            status = self._lib.ncclCommInitRankConfig(
                ctypes.byref(handle), self._size, unique, self._rank, ctypes.byref(config)
            )
        else:
            status = self._lib.ncclCommInitRank(ctypes.byref(handle), self._size, unique, self._rank)
        self._comm = handle.value
        operation = "ncclCommInitRank"
        if status == Result.ncclUnhandledCudaError or status == Result.ncclSystemError:
            cause = error_for(status, operation, rank=self._rank, comm=self._comm, library=self._lib)
            raise DeviceUnavailable(
                f"{cause.message}; NCCL could not set up GPU {self._device}", rank=self._rank, operation=operation
            )
        self._settle(status, operation, deadline, timeout=self._timeout)
        for name, expected in (("ncclCommCount", self._size), ("ncclCommUserRank", self._rank)):
            value = ctypes.c_int()
            check(getattr(self._lib, name)(self._comm, ctypes.byref(value)), name, rank=self._rank, comm=self._comm)
            if value.value != expected:
                raise FerrodistError(f"rank {self._rank}: {name} says {value.value}, expected {expected}")

    @classmethod
    def from_group(
        cls,
        group: Group,
        *,
        device: int | None = None,
        config: NcclConfig | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> NcclCommunicator:
        """Create one communicator per rank of a CPU ``group`` (call on every rank).

        Every rank first checks NCCL and its GPU and the group compares the results, so one
        rank without a GPU makes every rank fail at once (not time out); then rank 0 makes
        the unique id and broadcasts its 128 bytes through ``group``.
        """
        rank, size = group.rank, group.size
        uid = np.zeros(UNIQUE_ID_BYTES, dtype=np.uint8)
        failure: FerrodistError | None = None
        try:
            library = load_library()
            _cuda.require_device(device, "NcclCommunicator.from_group", rank=rank)
            if rank == 0:
                uid[:] = np.frombuffer(get_unique_id(library), dtype=np.uint8)
        except FerrodistError as exc:
            failure = exc
        flags = np.zeros(size, dtype=np.int32)
        group.all_gather(flags, np.array([0 if failure else 1], dtype=np.int32), timeout=timeout)
        if failure is not None:
            raise failure
        missing = [r for r in range(size) if flags[r] == 0]
        if missing:
            raise DeviceUnavailable(
                f"rank {rank}: NcclCommunicator.from_group: rank(s) {missing} cannot use NCCL (no GPU or no "
                "library; their own errors say which); no communicator was created",
                rank=rank,
                operation="NcclCommunicator.from_group",
            )
        group.broadcast(uid, src=0, timeout=timeout)
        return cls(rank, size, uid.tobytes(), device=device, config=config, timeout=timeout)

    # -- description -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> int:
        """The CUDA device index of this communicator."""
        return self._device

    @property
    def stream(self) -> int:
        """The ``cudaStream_t`` collectives run on unless a call passes ``stream=``."""
        return self._open("stream")[1]

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"cuda:{self._device}"
        return f"NcclCommunicator(rank={self._rank}, size={self._size}, {state})"

    # -- plumbing ----------------------------------------------------------------------------
    def _open(self, operation: str) -> tuple[int, int]:
        if self._closed or self._comm is None or self._stream is None:
            raise FerrodistError(
                f"rank {self._rank}: {operation} on a closed (or aborted) NCCL communicator; create a new one",
                rank=self._rank,
                operation=operation,
            )
        return self._comm, self._stream

    def _async_state(self, operation: str) -> int:
        comm, _ = self._open(operation)
        state = ctypes.c_int()
        check(self._lib.ncclCommGetAsyncError(comm, ctypes.byref(state)), "ncclCommGetAsyncError", rank=self._rank)
        return state.value

    def _fail(self, state: int, operation: str) -> None:
        error = error_for(state, operation, rank=self._rank, comm=self._comm, library=self._lib)
        self.abort()
        raise error.with_context("NCCL reported an asynchronous error; the communicator was aborted")

    def _timed_out(self, operation: str, timeout: float) -> CollectiveTimeout:
        self.abort()
        return CollectiveTimeout(
            f"rank {self._rank}: {operation} did not finish within {timeout:g}s on cuda:{self._device}; "
            f"NCCL cannot say which of the {self._size} ranks is missing: check that every rank made the "
            "same calls in the same order; the communicator was aborted",
            rank=self._rank,
            operation=operation,
        )

    def wait_until(self, done: Callable[[], bool], operation: str, timeout: float | None = None) -> None:
        """Poll ``done()`` and NCCL's async error until ``done()`` is true or ``timeout`` passes."""
        limit = check_timeout(timeout, self._timeout, operation)
        deadline = time.monotonic() + limit
        delay = 1e-5
        while True:
            finished = done()
            state = self._async_state(operation)
            if state not in _PENDING:
                self._fail(state, operation)
            if finished:
                return
            if time.monotonic() >= deadline:
                raise self._timed_out(operation, limit)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _settle(self, status: int, operation: str, deadline: float, *, timeout: float) -> None:
        """Raise for ``status``; on ``ncclInProgress`` (non-blocking mode) poll until settled."""
        while status == Result.ncclInProgress and self._comm is not None:
            status = self._async_state(operation)
            if status == Result.ncclInProgress:
                if time.monotonic() >= deadline:
                    raise self._timed_out(operation, timeout)
                time.sleep(1e-4)
        check(status, operation, rank=self._rank, comm=self._comm, library=self._lib)

    def _call(self, operation: str, function: str, *args: Any) -> None:
        status = getattr(self._lib, function)(*args)
        self._settle(status, operation, time.monotonic() + self._timeout, timeout=self._timeout)

    def buffer(self, x: object, name: str, operation: str) -> DeviceBuffer:
        """``x`` as a device buffer, checked to be memory of this communicator's GPU (the
        device a ``Tensor`` knows, or CUDA's answer for a bare pointer)."""
        buf = device_buffer(x, name=name, operation=operation, rank=self._rank)
        if buf.count:
            where = buf.device if buf.device is not None else _cuda.pointer_device(buf.ptr)
            if where != self._device:
                place = "host memory" if where is None else f"on cuda:{where}"
                raise InvalidArgument(
                    f"rank {self._rank}: {operation}: {name} is {place}, but this communicator runs on "
                    f"cuda:{self._device}; move it there first",
                    rank=self._rank,
                    operation=operation,
                )
        return buf

    def _stream_for(self, stream: object) -> int:
        _, own = self._open("stream")
        return own if stream is None else _cuda.stream_handle(stream)

    # -- collectives (enqueue only) ----------------------------------------------------------
    def all_reduce(
        self, sendbuf: Any, recvbuf: Any = None, op: ReduceOp | str = ReduceOp.SUM, *, stream: Any = None
    ) -> None:
        """Enqueue ``recvbuf = reduce(sendbuf over ranks)``; in place when ``recvbuf`` is None."""
        send, recv = self._pair("all_reduce", sendbuf, recvbuf, 1)
        rop = nccl_op(op, send.dtype, operation="all_reduce", rank=self._rank)
        dt = nccl_datatype(send.dtype, operation="all_reduce", rank=self._rank)
        comm, _ = self._open("all_reduce")
        self._call(
            "all_reduce", "ncclAllReduce", send.ptr, recv.ptr, send.count, dt, rop, comm, self._stream_for(stream)
        )

    def broadcast(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, *, stream: Any = None) -> None:
        """Enqueue: every rank's ``recvbuf`` (or ``sendbuf`` in place) gets ``root``'s ``sendbuf``."""
        send, recv = self._pair("broadcast", sendbuf, recvbuf, 1)
        dt = nccl_datatype(send.dtype, operation="broadcast", rank=self._rank)
        comm, _ = self._open("broadcast")
        root = self._root(root, "broadcast")
        self._call(
            "broadcast", "ncclBroadcast", send.ptr, recv.ptr, send.count, dt, root, comm, self._stream_for(stream)
        )

    def reduce(
        self, sendbuf: Any, recvbuf: Any = None, root: int = 0, op: ReduceOp | str = ReduceOp.SUM, *, stream: Any = None
    ) -> None:
        """Enqueue: ``root``'s ``recvbuf`` (or ``sendbuf``) gets the reduction over ranks."""
        send, recv = self._pair("reduce", sendbuf, recvbuf, 1)
        rop = nccl_op(op, send.dtype, operation="reduce", rank=self._rank)
        dt = nccl_datatype(send.dtype, operation="reduce", rank=self._rank)
        comm, _ = self._open("reduce")
        root = self._root(root, "reduce")
        self._call(
            "reduce", "ncclReduce", send.ptr, recv.ptr, send.count, dt, rop, root, comm, self._stream_for(stream)
        )

    def all_gather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:
        """Enqueue: ``recvbuf`` (``size`` times larger) gets every rank's ``sendbuf``, rank-major."""
        send, recv = self._pair("all_gather", sendbuf, recvbuf, self._size)
        dt = nccl_datatype(send.dtype, operation="all_gather", rank=self._rank)
        comm, _ = self._open("all_gather")
        self._call("all_gather", "ncclAllGather", send.ptr, recv.ptr, send.count, dt, comm, self._stream_for(stream))

    def reduce_scatter(
        self, sendbuf: Any, recvbuf: Any, op: ReduceOp | str = ReduceOp.SUM, *, stream: Any = None
    ) -> None:
        """Enqueue: rank i's ``recvbuf`` gets the reduction of block i of every rank's ``sendbuf``."""
        recv, send = self._pair("reduce_scatter", recvbuf, sendbuf, self._size, names=("recvbuf", "sendbuf"))
        rop = nccl_op(op, recv.dtype, operation="reduce_scatter", rank=self._rank)
        dt = nccl_datatype(recv.dtype, operation="reduce_scatter", rank=self._rank)
        comm, _ = self._open("reduce_scatter")
        stream_handle = self._stream_for(stream)
        self._call("reduce_scatter", "ncclReduceScatter", send.ptr, recv.ptr, recv.count, dt, rop, comm, stream_handle)

    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        """Enqueue a send of ``buf`` to ``peer`` (matched by the peer's :meth:`recv`, in order)."""
        self._p2p("send", "ncclSend", buf, peer, stream)

    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        """Enqueue a receive into ``buf`` from ``peer``."""
        self._p2p("recv", "ncclRecv", buf, peer, stream)

    def copy(self, dst: Any, src: Any, *, stream: Any = None) -> None:
        """Enqueue a device-to-device copy of ``src`` into ``dst`` (same dtype and size)."""
        source, target = self._pair("copy", src, dst, 1, names=("src", "dst"))
        if source.count:
            _cuda.memcpy_async(target.ptr, source.ptr, source.nbytes, self._stream_for(stream))

    def _p2p(self, operation: str, function: str, buf: Any, peer: int, stream: Any) -> None:
        target = self.buffer(buf, "buf", operation)
        dt = nccl_datatype(target.dtype, operation=operation, rank=self._rank)
        comm, _ = self._open(operation)
        peer = self._root(peer, operation, what="peer")
        self._call(operation, function, target.ptr, target.count, dt, peer, comm, self._stream_for(stream))

    def _root(self, root: int, operation: str, *, what: str = "root") -> int:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self._size:
            raise InvalidRank(
                f"rank {self._rank}: {operation}: {what} {root!r} is outside 0..{self._size - 1}",
                rank=self._rank,
                operation=operation,
            )
        return root

    def _pair(
        self, operation: str, first: Any, second: Any, ratio: int, *, names: tuple[str, str] = ("sendbuf", "recvbuf")
    ) -> tuple[DeviceBuffer, DeviceBuffer]:
        """Two buffers of one dtype with ``second.count == ratio * first.count`` (``second``
        defaults to ``first`` when ``ratio`` is 1)."""
        a = self.buffer(first, names[0], operation)
        b = a if second is None and ratio == 1 else self.buffer(second, names[1], operation)
        if a.dtype is not b.dtype or b.count != ratio * a.count:
            expected = f"{ratio} x {a.count}" if ratio != 1 else f"{a.count}"
            raise InvalidArgument(
                f"rank {self._rank}: {operation}: {names[1]} holds {b.count} {b.dtype.name}, expected {expected} "
                f"{a.dtype.name} to match {names[0]}",
                rank=self._rank,
                operation=operation,
            )
        return a, b

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Fuse the calls made inside into one launch (``ncclGroupStart``/``ncclGroupEnd``).

        Example::

            with comm.group():            # exchange with a neighbour without deadlock
                comm.send(a, peer=(rank + 1) % size)
                comm.recv(b, peer=(rank - 1) % size)
        """
        self._open("ncclGroupStart")
        check(self._lib.ncclGroupStart(), "ncclGroupStart", rank=self._rank)
        try:
            yield
        except BaseException:
            self._lib.ncclGroupEnd()  # close the group; the error from the body is the one to report
            raise
        self._call("ncclGroupEnd", "ncclGroupEnd")

    # -- waiting -----------------------------------------------------------------------------
    def work(self, operation: str, *, stream: Any = None, timeout: float | None = None) -> NcclWork:
        """A handle that waits for everything enqueued so far on the stream."""
        event = _cuda.create_event()
        try:
            _cuda.record_event(event, self._stream_for(stream))
        except BaseException:
            _cuda.destroy_event(event)
            raise
        return NcclWork(self, event, operation, check_timeout(timeout, self._timeout, operation))

    def mark(self) -> int:
        """An event recorded after everything enqueued so far on the communicator's stream
        (poll it with :meth:`finished`, release it with :meth:`forget`)."""
        event = _cuda.create_event()
        try:
            _cuda.record_event(event, self._stream_for(None))
        except BaseException:
            _cuda.destroy_event(event)
            raise
        return event

    def finished(self, mark: int) -> bool:
        """True once the work before ``mark`` has run (never blocks)."""
        return _cuda.query_event(mark)

    def forget(self, mark: int) -> None:
        _cuda.destroy_event(mark)

    def synchronize(self, timeout: float | None = None, *, stream: Any = None) -> None:
        """Wait until the stream is idle; ``CollectiveTimeout`` (after aborting) past ``timeout``."""
        handle = self._stream_for(stream)
        self.wait_until(lambda: _cuda.query_stream(handle), "synchronize", timeout)

    def check_async_error(self) -> None:
        """Raise (and abort) if NCCL has recorded an asynchronous error, e.g. a peer that died."""
        state = self._async_state("check_async_error")
        if state not in _PENDING:
            self._fail(state, "check_async_error")

    # -- teardown ----------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Finish outstanding work, then finalize and destroy the communicator (idempotent)."""
        if self._closed:
            return
        limit = check_timeout(timeout, self._timeout, "close")
        try:
            self.synchronize(limit)
            comm, _ = self._open("close")
            if self._lib.has("ncclCommFinalize"):
                status = self._lib.ncclCommFinalize(comm)
                self._settle(status, "ncclCommFinalize", time.monotonic() + limit, timeout=limit)
            check(self._lib.ncclCommDestroy(comm), "ncclCommDestroy", rank=self._rank)
            self._comm = None
        finally:
            self._release(abort=self._comm is not None)

    def abort(self) -> None:
        """Abort the communicator at once (pending operations are cancelled); idempotent."""
        self._release(abort=True)

    def _release(self, *, abort: bool) -> None:
        comm, stream = self._comm, self._stream
        self._comm, self._stream, self._closed = None, None, True
        if comm is not None and abort:
            self._lib.ncclCommAbort(comm)  # its status cannot change what happens next
        if stream is not None:
            with contextlib.suppress(FerrodistError):
                _cuda.destroy_stream(stream)

    def __enter__(self) -> NcclCommunicator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
