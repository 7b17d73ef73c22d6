"""Collectives on CUDA tensors: which device engine runs them, chosen once per group.

collectives cannot import ``ferrodist.gpu`` or ``ferrodist.nccl`` (both are built on top
of it or beside it), so each advertises an :class:`~ferrodist.core.EngineProvider`
under the entry points ``ferrodist.device_engines``: ``staged`` (ferrodist-gpu: through
pinned host memory and the group's CPU route) and ``nccl`` (ferrodist-nccl: device to
device).

A group chooses its engine in its first call on CUDA tensors, in a call of its own that
every rank runs at the same point of its program (``cuda route`` in messages): each rank
says which route it asks for (``auto``, ``nccl``, ``staged``), whether it can run NCCL,
with which GPU and NCCL release, and every rank decides the same from what all said
(:func:`choose`): NCCL when every rank asks for it or for ``auto`` and every rank has NCCL
and a GPU of its own; else the staged engine. Ranks that ask for different routes, or a
forced route that some rank cannot run, fail every rank in that call, naming the ranks.
The choice is logged (logger ``ferrodist.collectives``) and printed with
``FERRODIST_DEBUG=route``.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import numpy as np

from ferrodist.core import (
    DeviceEngine,
    DeviceMessages,
    DeviceUnavailable,
    DType,
    EngineProvider,
    FerrodistError,
    GroupInfo,
    InvalidArgument,
    Probe,
    ReduceOp,
    Tensor,
)

from ._algorithms import ring
from ._call import Call
from ._checks import Blocks
from ._debug import debugging_routes

__all__ = ["ENV", "ROUTES", "Choice", "DeviceRoute", "Record", "choose", "device_type", "requested_route"]

GROUP = "ferrodist.device_engines"
#: The routes a group may ask for.
ROUTES = ("auto", "nccl", "staged")
#: Environment variable with the route ``init_process_group`` asks for when not told.
ENV = "FERRODIST_CUDA_ROUTE"
#: Bytes each rank contributes to the route's setup call.
RECORD_BYTES = 256
_REASON_BYTES = RECORD_BYTES - 48
_log = logging.getLogger("ferrodist.collectives")


@functools.cache
def providers() -> dict[str, EngineProvider]:
    """The installed engine providers by name (a provider that fails to load is left out,
    with a warning saying why)."""
    found: dict[str, EngineProvider] = {}
    for ep in entry_points(group=GROUP):
        try:
            found[ep.name] = ep.load()()
        except Exception as exc:  # a broken install of one engine must not break the others
            _log.warning("device engine %r (%s) cannot be loaded: %s: %s", ep.name, ep.value, type(exc).__name__, exc)
    return found


def requested_route(value: str | None, *, rank: int | None = None) -> str:
    """The route asked for: ``value``, else ``$FERRODIST_CUDA_ROUTE``, else ``"auto"``."""
    source = "cuda_route"
    if value is None:
        value, source = os.environ.get(ENV, "") or "auto", ENV
    route = str(value).strip().lower()
    if route not in ROUTES:
        where = f"rank {rank}: " if rank is not None else ""
        raise InvalidArgument(
            f"{where}{source}={value!r} is not a CUDA route; use one of {', '.join(ROUTES)} "
            "(auto: NCCL where every rank has its own GPU and NCCL loads, else staged through host memory)"
        )
    return route


def device_type(rank: int, operation: str, tensors: Sequence[Tensor]) -> str | None:
    """The device type of ``tensors`` (all on one), or None for CPU tensors."""
    kinds = {t.device.type for t in tensors}
    if kinds == {"cpu"}:
        return None
    if len(kinds) > 1:
        raise InvalidArgument(
            f"rank {rank}: {operation}: the tensors are on different devices ({', '.join(sorted(kinds))}); "
            "put them all on the CPU or all on the GPU",
            rank=rank,
            operation=operation,
        )
    kind = kinds.pop()
    if kind != "cuda":
        raise DeviceUnavailable(f"rank {rank}: {operation}: collectives on {kind} tensors are not supported")
    return kind


# ---------------------------------------------------------------------------------------
# What each rank says, and the choice every rank makes from it
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One rank's part of the route setup.

    Attributes:
        requested: the route this rank asks for (one of :data:`ROUTES`).
        staged: whether the staged engine (ferrodist-gpu) is installed here.
        nccl: what the NCCL engine's probe found here.
    """

    requested: str
    staged: bool
    nccl: Probe

    def encode(self) -> np.ndarray[Any, Any]:
        reason = self.nccl.reason.encode()[:_REASON_BYTES]
        device = self.nccl.device[:32]
        head = struct.pack(
            "<BBBBI32sH",
            ROUTES.index(self.requested),
            self.staged,
            self.nccl.usable,
            len(device),
            self.nccl.version,
            device,
            len(reason),
        )
        out = np.zeros(RECORD_BYTES, np.uint8)
        out[: len(head)] = np.frombuffer(head, np.uint8)
        out[48 : 48 + len(reason)] = np.frombuffer(reason, np.uint8)
        return out

    @classmethod
    def decode(cls, raw: np.ndarray[Any, Any]) -> Record:
        data = raw.tobytes()
        route, staged, usable, dlen, version, device, rlen = struct.unpack_from("<BBBBI32sH", data)
        reason = data[48 : 48 + rlen].decode(errors="replace")
        requested = ROUTES[route] if route < len(ROUTES) else "?"
        return cls(requested, bool(staged), Probe(bool(usable), reason, device[:dlen], version))


@dataclass(frozen=True)
class Choice:
    """The engine a group's CUDA tensors take, and why (as logged)."""

    engine: str
    reason: str


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _nccl_obstacles(records: Sequence[Record]) -> list[str]:
    """Why NCCL cannot run this group (empty when it can), one phrase per obstacle."""
    problems = []
    unusable = [r for r, rec in enumerate(records) if not rec.nccl.usable]
    for r in unusable:
        problems.append(f"rank {r} cannot: {records[r].nccl.reason or 'no reason given'}")
    owners: dict[bytes, list[int]] = {}
    for r, rec in enumerate(records):
        if rec.nccl.usable:
            owners.setdefault(rec.nccl.device, []).append(r)
    for ranks in owners.values():
        if len(ranks) > 1:
            problems.append(f"{_ranks(ranks)} share one GPU (NCCL needs a GPU per rank)")
    versions = {rec.nccl.version for rec in records if rec.nccl.usable}
    if len(versions) > 1:
        problems.append(f"the ranks load different NCCL releases ({', '.join(str(v) for v in sorted(versions))})")
    return problems


def choose(records: Sequence[Record]) -> Choice:
    """The route every rank takes, from every rank's :class:`Record` (group-rank order).

    Raises:
        InvalidArgument: the ranks ask for different routes (each rank's request named).
        DeviceUnavailable: the route asked for cannot run on some rank (those ranks named).
    """
    asked = {rec.requested for rec in records}
    if len(asked) > 1:
        by_route = {route: [r for r, rec in enumerate(records) if rec.requested == route] for route in sorted(asked)}
        listing = "; ".join(f"{_ranks(ranks)} asked for {route!r}" for route, ranks in by_route.items())
        raise InvalidArgument(
            f"the ranks ask for different CUDA routes ({listing}); every rank must ask for the same one "
            f"(init_process_group(cuda_route=...) or ${ENV})"
        )
    route = asked.pop()
    if route != "staged":
        problems = _nccl_obstacles(records)
        if not problems:
            version = records[0].nccl.version
            return Choice(
                "nccl", f"every rank has its own GPU and NCCL {version}" + (" (asked for)" if route == "nccl" else "")
            )
        if route == "nccl":
            raise DeviceUnavailable(
                f"the CUDA route 'nccl' was asked for but cannot run: {'; '.join(problems)}; "
                "fix that, or ask for cuda_route='auto' (or 'staged') to copy through host memory instead"
            )
    missing = [r for r, rec in enumerate(records) if not rec.staged]
    if missing:
        raise DeviceUnavailable(
            f"collectives on CUDA tensors go through the staged engine here, which {_ranks(missing)} lack: "
            "pip install -e ./packages/gpu (from a clone of ferrodist) on every rank"
        )
    if route == "staged":
        return Choice("staged", "asked for")
    return Choice("staged", "not every rank can run NCCL: " + "; ".join(_nccl_obstacles(records)))


def local_record(requested: str) -> Record:
    """This process's record: what it asks for and what its engines' probes found."""
    found = providers()
    nccl = found.get("nccl")
    if nccl is None:
        probe = Probe(
            False,
            "ferrodist-nccl is not installed (pip install -e './packages/nccl[cu12]' or '[cu13]' from a clone of ferrodist)",
        )
    elif requested == "staged":
        probe = Probe(False, "the staged route was asked for")  # NCCL is not needed: do not load it
    else:
        probe = nccl.probe()
    return Record(requested, "staged" in found, probe)


# ---------------------------------------------------------------------------------------
# One group's route
# ---------------------------------------------------------------------------------------


class DeviceRoute:
    """The device engine of one group: none until the group's first call on CUDA tensors
    runs :meth:`setup` (in a call of its own), then that engine for every later call."""

    def __init__(self, requested: str) -> None:
        self.requested = requested
        self.engine: DeviceEngine | None = None
        self.choice: Choice | None = None
        self.lock = threading.Lock()  # one setup, when two threads make a first CUDA call at once

    def setup(self, call: Call, info: GroupInfo) -> None:
        """The body of the setup call: exchange records, choose, start the engine."""
        mine = local_record(self.requested)
        everyone = np.zeros(call.size * RECORD_BYTES, np.uint8)
        blocks = Blocks.of(everyone, call.size)
        blocks[call.rank][...] = mine.encode()
        ring.all_gather(call, blocks)
        records = [Record.decode(block) for block in blocks]
        try:
            choice = choose(records)
        except FerrodistError as exc:
            raise exc.with_context(f"rank {call.ranks[call.rank]}: cuda route of group {info.name}") from None
        engine = providers()[choice.engine].engine(info)
        engine.start(call)
        _log.info("group %s: CUDA tensors go through the %s engine (%s)", info.name, choice.engine, choice.reason)
        if debugging_routes():
            print(
                f"[ferrodist] rank {call.ranks[call.rank]}: group {info.name}: CUDA route {choice.engine} "
                f"({choice.reason})",
                flush=True,
            )
        self.choice, self.engine = choice, engine

    def for_call(self, engine: DeviceEngine, dt: DType, op: ReduceOp | None) -> DeviceEngine:
        """``engine``, or the staged engine for a call ``engine`` does not support (the same
        on every rank: it depends on the call's dtype and op only)."""
        if engine.supports(dt, op):
            return engine
        staged = providers().get("staged")
        if staged is None:
            raise DeviceUnavailable(
                f"{engine.name} cannot run this call ({dt.name}, {op.name if op else 'data movement'}) and the "
                "staged engine that would is not installed: pip install -e ./packages/gpu (from a clone of ferrodist)"
            )
        return staged.engine(GroupInfo("staged", 0, 1, 0.0))

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


def messages(rank: int, operation: str) -> DeviceMessages:
    """What sends and receives CUDA tensors (the staged engine, on every route)."""
    provider = providers().get("staged")
    if provider is None:
        raise DeviceUnavailable(
            f"rank {rank}: {operation} of CUDA tensors needs ferrodist-gpu (pip install -e ./packages/gpu from a clone of ferrodist): "
            f"no package provides the 'staged' engine in the {GROUP!r} entry points",
            rank=rank,
            operation=operation,
        )
    engine = provider.engine(GroupInfo("messages", 0, 1, 0.0))
    if not isinstance(engine, DeviceMessages):
        raise DeviceUnavailable(f"rank {rank}: {operation}: the installed staged engine cannot send CUDA tensors")
    return engine
