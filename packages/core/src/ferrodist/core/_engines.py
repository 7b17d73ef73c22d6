"""The device-engine protocol: how a group hands collectives on device tensors (CUDA) to
the package that runs them. It lives in core, beside the group protocol, so the packages
that provide engines (``ferrodist.gpu``, ``ferrodist.nccl``) and the one that calls them
(``ferrodist.collectives``) meet here and import nothing of each other.

A ``ProcessGroup`` (``ferrodist.collectives``) checks a call's arguments, gives it its
number, fingerprint and deadline, and, for device tensors, calls the group's
:class:`DeviceEngine` inside that call. Two engines exist:

- the *staged* engine (``ferrodist.gpu``): copies through pinned host memory and runs the
  group's CPU route there (:class:`HostRoute`), so its ranks interoperate with CPU ranks;
- the *NCCL* engine (``ferrodist.nccl``): device to device through NCCL, fingerprinted over
  the group's CPU channel (:class:`EngineCall`) before anything is enqueued.

A package offers an engine through an :class:`EngineProvider` registered under the
entry-point group ``ferrodist.device_engines`` (the entry point's name is the engine's).
Each group chooses one engine for its CUDA tensors, once, with every rank agreeing (see
``ferrodist.collectives``); point-to-point messages of device tensors are always staged
(:class:`DeviceMessages`), whatever the group's engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._dtypes import DType
from ._errors import DeviceUnavailable, FerrodistError
from ._group import Work
from ._ops import ReduceOp
from ._tensor import Tensor

Buffer = np.ndarray[Any, Any]

__all__ = [
    "DeviceEngine",
    "DeviceMessages",
    "EngineCall",
    "EngineProvider",
    "GroupInfo",
    "HostMessages",
    "HostRoute",
    "Probe",
    "device_cast",
]

#: Entry points of the functions that convert device arrays between float32 and the 16-bit
#: floats, by device type: ``cuda = "ferrodist.gpu:cast"`` (ferrodist-gpu registers it).
CASTS = "ferrodist.device_casts"


class EngineCall(Protocol):
    """One collective call in flight, as a device engine sees it: the group's CPU channel
    for this call (messages carry the call's tag and fingerprint), its deadline (a
    ``time.monotonic()`` value) and identity. Ranks (``rank``, ``peer``) are group ranks."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def ranks(self) -> Sequence[int]:
        """Group rank -> transport (global) rank."""
        ...

    @property
    def deadline(self) -> float: ...

    @property
    def fingerprint(self) -> int: ...

    @property
    def seq(self) -> int:
        """The call's number on its group."""
        ...

    def remaining(self) -> float:
        """Seconds left before the deadline (``CollectiveTimeout`` when none are)."""
        ...

    def send(self, buf: Buffer, peer: int) -> None: ...

    def recv(self, buf: Buffer, peer: int) -> None: ...

    def isend(self, buf: Buffer, peer: int) -> Work: ...

    def irecv(self, buf: Buffer, peer: int) -> Work: ...

    def wait_all(self, requests: Sequence[Work]) -> None: ...

    def exchange(self, send_buf: Buffer, to: int, recv_buf: Buffer, frm: int) -> None: ...

    def agree(self) -> None:
        """Check with one small message per rank that every rank is in this very call
        (operation, dtype, count, op, root, route): ``CollectiveMismatch`` otherwise."""
        ...

    def aborted(self) -> FerrodistError | None:
        """The error the group was aborted with (here or by a peer's notice), or None:
        an engine waiting on the device polls this so a peer's failure ends its wait."""
        ...


class HostRoute(Protocol):
    """The group's CPU collectives on flat host arrays, inside the running call: the route a
    numpy array of that size takes (the transport's own collectives, or the ring, doubling
    and tree algorithms). Each method call is one *part* of the device call, and carries the
    call's fingerprint with the part's element count. ``root`` is a group rank."""

    def all_reduce(self, x: Buffer, dt: DType, op: ReduceOp) -> None: ...

    def broadcast(self, x: Buffer, root: int, dt: DType) -> None: ...

    def reduce(self, x: Buffer, root: int, dt: DType, op: ReduceOp) -> None: ...

    def all_gather(self, x: Buffer, out: Buffer, dt: DType) -> None:
        """``out`` (``size * len(x)`` elements, rank-major) = every rank's ``x``."""
        ...

    def reduce_scatter(self, out: Buffer, inp: Buffer, dt: DType, op: ReduceOp) -> None:
        """``out`` = the reduction over ranks of their block ``rank`` of ``inp``."""
        ...


class DeviceEngine(Protocol):
    """Runs one group's collectives on device tensors, inside calls the group started.

    Tensors are ``ferrodist.core.Tensor`` views of the caller's memory (the result is
    written there). Blocks (``blocks``, ``out``) hold one tensor per group rank, each with
    the element count and dtype of ``x``. Every wait is bounded by ``call.deadline``; an
    error is a ``FerrodistError`` naming this rank (the group then aborts on every rank).
    AVG is an ``op`` like the others: the engine divides (the staged engine through its
    host route, NCCL with ``ncclAvg``).
    """

    @property
    def name(self) -> str:
        """The engine's name: ``"staged"`` or ``"nccl"`` (in logs and ``FERRODIST_DEBUG=route``)."""
        ...

    @property
    def direct(self) -> bool:
        """True when data goes device to device without the group's CPU route, so every
        rank of a call must use this engine (the call's fingerprint then says so)."""
        ...

    def supports(self, dt: DType, op: ReduceOp | None) -> bool:
        """Whether this engine runs calls on ``dt`` with ``op`` (None: calls that only move
        data). The group sends a call this engine does not support through the staged
        engine, on every rank alike (the answer depends on the call's arguments only)."""
        ...

    def start(self, call: EngineCall) -> None:
        """Get ready for the group's device calls, inside the group's route-setup call that
        every rank runs at the same point (NCCL: the unique id travels over the CPU channel
        and the communicator is made, all within ``call.deadline``)."""
        ...

    def all_reduce(self, call: EngineCall, host: HostRoute, x: Tensor, op: ReduceOp, wire: DType) -> None:
        """Reduce ``x`` in place on every rank; ``wire`` is the dtype that travels
        (``x.dtype``, or bfloat16 for a float32 ``x`` compressed on the device)."""
        ...

    def broadcast(self, call: EngineCall, host: HostRoute, x: Tensor, root: int) -> None: ...

    def reduce(self, call: EngineCall, host: HostRoute, x: Tensor, root: int, op: ReduceOp) -> None:
        """Reduce into ``root``'s ``x``; other ranks' ``x`` is left as it was."""
        ...

    def all_gather(self, call: EngineCall, host: HostRoute, x: Tensor, blocks: Sequence[Tensor]) -> None: ...

    def reduce_scatter(
        self, call: EngineCall, host: HostRoute, out: Tensor, blocks: Sequence[Tensor], op: ReduceOp
    ) -> None:
        """``out`` = the reduction over ranks of their ``blocks[rank]``; ``blocks`` are not modified."""
        ...

    def gather(self, call: EngineCall, x: Tensor, blocks: Sequence[Tensor] | None, root: int) -> None: ...

    def scatter(self, call: EngineCall, x: Tensor, blocks: Sequence[Tensor] | None, root: int) -> None: ...

    def all_to_all(self, call: EngineCall, outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> None:
        """Rank i's ``inputs[j]`` into rank j's ``outputs[i]`` (sizes may differ per pair)."""
        ...

    def close(self) -> None:
        """Release what the engine holds for its group (a communicator, streams)."""
        ...


class HostMessages(Protocol):
    """What sends and receives host bytes for :class:`DeviceMessages`: a transport
    (``ferrodist.transport.Transport``), whose ranks and tags these are."""

    def isend(self, buf: Buffer, dst: int, tag: int = 0) -> Work: ...

    def irecv(self, buf: Buffer, src: int, tag: int = 0) -> Work: ...


@runtime_checkable
class DeviceMessages(Protocol):
    """Point-to-point messages of device tensors over a transport (always staged through
    host memory: they carry the transport's tags and deadlines, whatever the group's engine)."""

    def isend(self, transport: HostMessages, x: Tensor, peer: int, tag: int) -> Work: ...

    def irecv(self, transport: HostMessages, x: Tensor, peer: int, tag: int) -> Work: ...


@dataclass(frozen=True)
class Probe:
    """What one process can do with an engine (found once per process, without side effects
    on other processes).

    Attributes:
        usable: whether this process can run the engine.
        reason: why not (empty when usable), worded for a user.
        device: the identity of the device this process's rank would use (a GPU's UUID),
            so that ranks sharing one device are noticed; empty when there is none.
        version: the engine's library version as one integer (NCCL's code), 0 when none.
    """

    usable: bool
    reason: str = ""
    device: bytes = b""
    version: int = 0


@dataclass(frozen=True)
class GroupInfo:
    """What a provider knows of the group it makes an engine for."""

    name: str
    rank: int  # this rank's group rank
    size: int
    timeout: float  # the group's default timeout (seconds)


class EngineProvider(Protocol):
    """What a package registers under the entry points ``ferrodist.device_engines``."""

    @property
    def name(self) -> str: ...

    @property
    def device_type(self) -> str:
        """The device type its engines run on (``"cuda"``)."""
        ...

    def probe(self) -> Probe:
        """Whether this process can run the engine (cheap after the first call)."""
        ...

    def engine(self, group: GroupInfo) -> DeviceEngine:
        """The engine for one group (the staged engine is one per process; an NCCL engine
        has its group's communicator, made in :meth:`DeviceEngine.start`)."""
        ...


def device_cast(device_type: str, purpose: str) -> Callable[..., None]:
    """The function that converts device arrays on ``device_type`` (``"cuda"``) between
    float32 and float16/bfloat16 (``cast(dst, dst_dtype, src, src_dtype, *, stream=None)``),
    from the package registered for it under the entry points ``ferrodist.device_casts``
    (ferrodist-gpu for CUDA): an engine that needs one (NCCL's bf16 compression) finds it
    without importing that package. ``DeviceUnavailable`` naming ``purpose`` and what to
    install when none is registered."""
    for ep in entry_points(group=CASTS, name=device_type):
        cast: Callable[..., None] = ep.load()
        return cast
    raise DeviceUnavailable(
        f"{purpose} converts on the GPU with ferrodist-gpu's kernels, which are not installed: pip install -e ./packages/gpu (from a clone of ferrodist)"
    )
