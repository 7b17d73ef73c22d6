"""Making a group when torch asks for one (``_plugin`` registers the backend).

torch calls ``create`` for every process group with backend ``"ferrodist"`` (the default
group, ``new_group``, a ``DeviceMesh``'s dimensions), on the members only, with a store
prefixed for that group. The group's ranks start a ferrodist transport of their own
through that store (``rendezvous=``): rank 0 hosts ferrodist's store on a port the OS
picks and publishes it there, so nothing else has to be agreed on.

The first group over every rank (the default group) starts the transport; every later
group whose members it has (``new_group``, a ``DeviceMesh``'s dimensions) is a
``subgroup`` of it: the same sockets or arena, a channel of its own, made by the members
alone in milliseconds. A group made while no such world group lives, or while
``FERRODIST_TORCH_TRANSPORT`` names another transport than the world's, starts its own.

Which transport (``FERRODIST_TORCH_TRANSPORT``): ``shm`` when the launcher says every rank
runs on this host (torchrun's and ``ferrodist run``'s ``LOCAL_WORLD_SIZE``), ``levels`` when
it says the ranks span hosts (``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``, or a node number:
tcp between nodes and each node's shared memory inside, as ``init_process_group("auto")``
does), else ``tcp`` (``auto``, the default; ``tcp`` also when the launcher's variables are
there only in part, as where ranks are started by hand with ``rank=`` and ``world_size=``);
or ``shm``, ``tcp``, ``levels``, ``mpi`` (the world group under mpiexec).
"""

from __future__ import annotations

import logging
import os
import weakref
from datetime import timedelta
from typing import Any

from ferrodist.collectives import (
    DEFAULT_DTYPES,
    ProcessGroup,
    Transport,
    auto_backend,
    connect_transport,
    destroy_process_group,
    enable_two_levels,
    one_host,
)
from ferrodist.collectives import preload as load_kernels
from ferrodist.core import DType, InvalidArgument

from ._group import FerrodistProcessGroup
from ._names import TRANSPORT_VARIABLE, TRANSPORTS

_log = logging.getLogger("ferrodist.torch")
#: The torch groups over every rank that started a transport (with its kind), the live one last.
_worlds: list[tuple[weakref.ref[FerrodistProcessGroup], str]] = []


def create(common: Any, options: Any = None) -> FerrodistProcessGroup:
    """torch's creator (extended API): ``common`` carries the group's prefixed store, this
    rank in the group, its size, the timeout and the group's name."""
    rank, size = int(common.group_rank), int(common.group_size)
    timeout = _seconds(common.timeout)
    name = str(common.group_id)
    members = list(common.global_ranks_in_group) or list(range(size))
    world = _world()
    if world is not None and all(0 <= m < world.size for m in members):
        # torch's global ranks are the world group's ranks (renumbered, once it has shrunk)
        group = world.subgroup([world.ranks[m] for m in members], name=f"torch:{name}", timeout=timeout)
        _log.info("torch process group %s (global ranks %s): a subgroup of %s", name, _listed(members), world.name)
        return FerrodistProcessGroup(group, common.store, description=name, owns_transport=False)
    kind = choose_transport(size, name)
    transport = connect(kind, common.store, rank, size, timeout)
    group = ProcessGroup(
        transport,
        range(size),
        0,
        timeout=timeout,
        name=f"torch:{name}",
        debug=os.environ.get("FERRODIST_DEBUG", "").lower() in ("detail", "1", "true", "yes"),
    )
    if kind == "levels":
        _two_levels(group, name)
    _log.info(
        "torch process group %s (global ranks %s): rank %d of %d over ferrodist's %s transport",
        name,
        _listed(members),
        rank,
        size,
        transport.kind,
    )
    made = FerrodistProcessGroup(group, common.store, description=name)
    if members == list(range(size)) and world is None:
        _worlds.append((weakref.ref(made), kind))
    return made


def adopt_world(made: FerrodistProcessGroup) -> None:
    """``made``, the default group shrunk, is the world group later groups share (``shrink_group``)."""
    kind = _worlds[-1][1] if _worlds else made.ferrodist_group.transport.kind
    _worlds.append((weakref.ref(made), kind))


def _two_levels(group: ProcessGroup, name: str) -> None:
    """The group's collectives over two levels (a collective of its ranks); on failure the
    group and its transport are closed and the error raised."""
    try:
        levels = enable_two_levels(group)
    except BaseException:
        destroy_process_group(group)
        group.transport.close()
        raise
    _log.info("torch process group %s: %s", name, levels or "one node, or one rank per node: flat tcp")


def _world() -> ProcessGroup | None:
    """The ferrodist group of the live torch group over every rank (the default group) that
    a new group shares the transport of, or None: none lives, or FERRODIST_TORCH_TRANSPORT
    now names another transport than the world's (the new group then starts that one)."""
    while _worlds:
        made, kind = _worlds[-1][0](), _worlds[-1][1]
        if made is not None and not made.closed:
            wanted = os.environ.get(TRANSPORT_VARIABLE, "auto").strip().lower() or "auto"
            return made.ferrodist_group if wanted in ("auto", kind) else None
        _worlds.pop()
    return None


def _listed(members: list[int]) -> object:
    return members if len(members) <= 16 else f"{members[:16]}..."


def choose_transport(size: int, name: str = "0") -> str:
    """The transport a group of ``size`` ranks runs over (see the module docstring)."""
    chosen = os.environ.get(TRANSPORT_VARIABLE, "auto").strip().lower() or "auto"
    if chosen not in TRANSPORTS:
        raise InvalidArgument(
            f"FERRODIST_TORCH_TRANSPORT={chosen!r} is not one of {', '.join(TRANSPORTS)} (group {name})"
        )
    if chosen != "auto":
        return chosen
    if size == 1:
        return "tcp"  # nothing to share memory with
    # torch may have placed the ranks already (init_method, rank=, world_size=): launcher
    # variables that do not add up only leave unknown whether every rank runs on this host
    if one_host():
        return "shm"
    try:
        backend, _, info = auto_backend()
    except InvalidArgument:
        return "tcp"
    return "levels" if backend == "levels" and info is not None and info.world_size == size else "tcp"


def connect(kind: str, store: Any, rank: int, size: int, timeout: float) -> Transport:
    """This rank's transport of ``kind`` (``levels``: tcp, the levels come after), started
    through torch's ``store``."""
    return connect_transport("tcp" if kind == "levels" else kind, store, rank=rank, world_size=size, timeout=timeout)


def _seconds(timeout: object) -> float:
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return 1800.0  # torch's own default for a process group


def preload(dtypes: tuple[DType | str, ...] = DEFAULT_DTYPES, *, ranks: int = 4, timeout: float = 300.0) -> int:
    """Import the backend (ferrodist's collectives and transports with it) and load the
    compiled kernels of collectives over ``dtypes`` (``ferrodist.collectives.preload``) into
    this process; returns how many kernels. Ranks forked from this process afterwards make
    their groups without importing or loading anything: for harnesses that fork each test's
    ranks from one parent, as torch's ``MultiProcessTestCase`` does (torch and Gloo are
    imported in that parent; this puts ferrodist on the same footing). A rank started fresh
    (torchrun, ``ferrodist run``, spawn) gains nothing from it."""
    return load_kernels(dtypes, ranks=ranks, timeout=timeout)
