"""The ``Transport`` protocol: how ranks move bytes. Every blocking call takes a timeout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ferrodist.core import DType, FerrodistError, ReduceOp

from ._aborts import Notice

__all__ = ["DEFAULT_TIMEOUT", "NativeCollectives", "Request", "Store", "Transport"]

#: Seconds a blocking call waits when neither the call nor the transport says otherwise.
DEFAULT_TIMEOUT = 300.0

Buffer = np.ndarray[Any, Any]


@runtime_checkable
class Request(Protocol):
    """A send or receive in flight."""

    def wait(self, timeout: float | None = None) -> None:
        """Block until done (``timeout`` seconds at most, the transport's timeout if ``None``).

        Raises the transfer's error (``PeerLost``, ``CollectiveMismatch``, ...) or
        ``CollectiveTimeout`` naming the peer that did not arrive.
        """
        ...

    def is_completed(self) -> bool:
        """True once the transfer finished, successfully or not (never blocks)."""
        ...


class Store(Protocol):
    """A key-value store every rank of the job reaches (rendezvous, coordination)."""

    def set(self, key: str, value: bytes | str) -> None: ...

    def get(self, key: str, *, timeout: float) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def wait(self, keys: Sequence[str], *, timeout: float) -> None: ...

    def check(self, keys: Sequence[str]) -> bool: ...


class NativeCollectives(Protocol):
    """A transport's own collectives over a set of ranks (MPI's, the shared-memory arena's).

    Arrays are flat numpy arrays; ranks (``root``) are ranks of the set. ``deadline`` is a
    ``time.monotonic()`` value; ``fingerprint`` and ``seq`` identify the call (its kind and
    its number on the group), so that two different calls are never combined."""

    @property
    def size(self) -> int: ...

    #: all_reduce above this many bytes runs the collectives' own algorithms instead.
    all_reduce_up_to: int

    def supports(self, dt: DType, op: ReduceOp | None = None) -> bool: ...

    def all_reduce(
        self, x: Buffer, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None: ...

    def all_reduce_compressed(
        self, x: Buffer, wire: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None:
        """``all_reduce`` of the float32 array ``x`` rounded to ``wire`` (bfloat16), what
        ``all_reduce`` of the rounded array would do to the bit, the result widened back
        into ``x``; called where ``supports(wire, op)``."""
        ...

    def bound_all_reduce(self, dt: DType, op: ReduceOp, count: int) -> Callable[[Buffer, float, int, int], None] | None:
        """``all_reduce`` of ``count`` elements of ``dt`` with ``op``, bound to them once:
        ``call(x, deadline, fingerprint, seq)``; None where there is nothing to bind."""
        ...

    def reduce(
        self, x: Buffer, root: int, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None: ...

    def broadcast(
        self, x: Buffer, root: int, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None: ...

    def all_gather(
        self, x: Buffer, out: Buffer, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None: ...

    def reduce_scatter(
        self, blocks: Buffer, out: Buffer, dt: DType, op: ReduceOp, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None: ...

    def gather(
        self, x: Buffer, out: Buffer | None, root: int, dt: DType, deadline: float, fingerprint: int = 0, seq: int = 0
    ) -> None: ...

    def scatter(
        self,
        blocks: Buffer | None,
        x: Buffer,
        root: int,
        dt: DType,
        deadline: float,
        fingerprint: int = 0,
        seq: int = 0,
    ) -> None: ...

    def barrier(self, deadline: float, fingerprint: int = 0, seq: int = 0) -> None: ...

    def free(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """Point-to-point byte movement between the ranks of one job.

    Buffers are C-contiguous numpy arrays (any dtype; their bytes are moved).
    Messages between a pair of ranks are matched by ``(source, tag)`` in the order
    they were sent. A receive names the exact byte count it expects (the size of its
    buffer); a message of another size is a ``CollectiveMismatch``.

    A send and a receive may each carry a ``fingerprint``, a non-zero integer that
    describes the call they belong to. When both are non-zero and differ, the receive
    fails with ``CollectiveMismatch`` (``expected`` = the receiver's, ``received`` = the
    sender's) and its buffer is left untouched.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def timeout(self) -> float:
        """Default seconds for blocking calls."""
        ...

    def send(
        self, buf: Buffer, dst: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0
    ) -> None: ...

    def recv(
        self, buf: Buffer, src: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0
    ) -> None: ...

    def isend(self, buf: Buffer, dst: int, tag: int = 0, *, fingerprint: int = 0) -> Request: ...

    def irecv(self, buf: Buffer, src: int, tag: int = 0, *, fingerprint: int = 0) -> Request: ...

    def irecv_any(self, buf: Buffer, sources: Sequence[int], tag: int = 0, *, fingerprint: int = 0) -> Request:
        """Receive the next message with ``tag`` that any of ``sources`` sends: one that came
        before takes it (the first to come), else the first to come after. It competes with
        the receives that name a sender: a message goes to the one posted first. The
        request's ``source`` is the sender once its message has begun to arrive (None
        before); a wait that runs out names every one of ``sources``."""
        ...

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
        ...

    def barrier(self, *, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...

    # -- what it is, where it runs -------------------------------------------------------------
    @property
    def kind(self) -> str:
        """The name ``init_process_group`` knows the transport by: ``"tcp"``, ``"shm"``,
        ``"mpi"`` or ``"simulated"``."""
        ...

    def share_host(self, ranks: int) -> None:
        """``ranks`` ranks of the job run on this host (this transport's, or more where nodes
        of one job share a host): where they outnumber the cores, the transport's waits give
        their core away before they sleep. A transport that does not wait itself ignores it."""
        ...

    # -- capabilities beyond moving bytes ------------------------------------------------------
    @property
    def store(self) -> Store | None:
        """The job's key-value store, or None (MPI jobs have none)."""
        ...

    def admit(self, peer: int, address: str, *, timeout: float | None = None) -> None:
        """Take the replacement of lost rank ``peer``, listening at ``address``, as rank
        ``peer`` from now on (a new process joining a running job; see
        ``TcpTransport.join``). ``BackendUnavailable`` where the transport cannot."""
        ...

    def native_collectives(self, ranks: Sequence[int], channel: int) -> NativeCollectives | None:
        """The transport's own collectives for ``ranks`` (every rank of the world calls this
        for every group, in the same order), or None where the transport has none for them.
        ``channel`` is the group's: the collectives stop when it is aborted."""
        ...

    # -- failures (see ``_aborts``) ----------------------------------------------------------
    def abort(self, channel: int, error: FerrodistError, *, peers: Sequence[int], seq: int) -> None:
        """Fail every pending and later send and receive on ``channel``'s tags with ``error``,
        here and, through a notice that says the sender was in call ``seq``, on ``peers``.
        Never blocks for long (a peer that does not take its notice is given up)."""
        ...

    def aborted(self, channel: int) -> FerrodistError | None:
        """The error ``channel`` was aborted with, here or by a peer's notice; None if it was not."""
        ...

    def on_abort(self, channel: int, respond: Callable[[FerrodistError, int], None]) -> None:
        """Call ``respond(error, seq)``, in a thread of the transport's, when a peer's notice is
        the first to abort ``channel`` on this rank."""
        ...

    def notices(self, channel: int) -> dict[int, Notice]:
        """The peers whose notice for ``channel`` arrived: the call each was in, and the
        failure of another group that held it up first (or None)."""
        ...

    def gone(self) -> frozenset[int]:
        """The peers known to have left: their connection ended (they exited, crashed, were
        killed, or closed their transport). A stopped or slow peer is not among them."""
        ...
