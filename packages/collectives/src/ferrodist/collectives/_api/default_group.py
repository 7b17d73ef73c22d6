"""The default process group: set by ``init_process_group``, cleared by ``destroy_process_group``.

A group made over a simulated transport passed in by the caller (ranks as threads of one
process) is the default group of the thread that made it; any other is the process's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ferrodist.collectives._call import subgroup_channel
from ferrodist.collectives._debug import enabled_by_environment
from ferrodist.collectives._device import requested_route
from ferrodist.collectives._failures import replacements
from ferrodist.collectives._failures.record import record_failure
from ferrodist.collectives._group import ProcessGroup
from ferrodist.collectives._start import levels
from ferrodist.collectives._start.backends import make_transport
from ferrodist.collectives._timeouts import seconds
from ferrodist.core import FerrodistError, InvalidArgument, InvalidRank, NotInitialized
from ferrodist.transport import DEFAULT_TIMEOUT, Transport

#: The least time the start may take when neither ``init_timeout`` nor FERRODIST_INIT_TIMEOUT says.
DEFAULT_INIT_TIMEOUT = 60.0

_thread_default = threading.local()
_process_default: list[ProcessGroup] = []  # zero or one element; a list so it can be cleared in place
_lock = threading.Lock()


def _current() -> ProcessGroup | None:
    group: ProcessGroup | None = _thread_default.__dict__.get("group")  # on every call: no getattr miss
    if group is None and _process_default:
        return _process_default[0]
    return group


def is_initialized() -> bool:
    """True when this thread has a default process group."""
    return _current() is not None


def default_group() -> ProcessGroup:
    """The group ``init_process_group`` made (this thread's, for a simulated world); what
    the module-level collectives act on when no ``group`` is given. Raises
    ``NotInitialized`` before ``init_process_group``."""
    group = _current()
    if group is None:
        raise NotInitialized(
            "no default process group: call ferrodist.collectives.init_process_group(...) first "
            "(or run the function with ferrodist.testing.run_world)"
        )
    return group


class _World:
    """``group.WORLD``: the default group of whoever uses it (this process's, or this
    thread's in a simulated world), looked up at each use; its attributes are the
    default group's (``group.WORLD.size``, ``group.WORLD.all_reduce(x)``)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle, inspect probing for hooks: not the group's
            raise AttributeError(name)
        return getattr(default_group(), name)

    def __repr__(self) -> str:
        return "<group.WORLD: the default process group>"


class group:  # torch's name (torch.distributed.group.WORLD), lower case
    """Named groups, as ``torch.distributed.group``: ``group.WORLD`` is the default group,
    accepted wherever a ``group`` argument is (it means the same as ``None``)."""

    WORLD: Any = _World()


def resolve(group: ProcessGroup | None) -> ProcessGroup:
    """The group a module-level call acts on (``None`` and ``group.WORLD``: the default)."""
    if group is None or isinstance(group, _World):
        return default_group()
    if not isinstance(group, ProcessGroup):
        raise InvalidArgument(
            f"group must be a ProcessGroup from new_group(), group.WORLD or None, not {type(group).__name__}"
        )
    return group


def init_process_group(
    backend: str = "auto",
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    init_timeout: float | timedelta | None = None,
    transport: Transport | None = None,
    debug: bool | None = None,
    cuda_route: str | None = None,
) -> ProcessGroup:
    """Create the default process group (the world) for this process, or this thread.

    Args:
        backend: ``"tcp"`` (real processes, one machine or many), ``"shm"`` (one machine),
            ``"mpi"``, ``"simulated"`` (ranks as threads of one process), or ``"auto"``:
            what fits the environment (a job of several ranks: shm on one host, tcp across
            hosts, mpi under mpiexec; else a simulated world of one). ``"gloo"`` means
            ``"auto"``; ``"nccl"`` means ``"auto"`` with ``cuda_route="nccl"``.
        init_method: ``"env://"`` (default: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
            ``WORLD_SIZE``, or the variables of mpiexec / SLURM) or ``"tcp://HOST:PORT"``.
        rank, world_size: override the environment. A simulated world of more than one
            rank needs ``transport=`` (from ``SimulatedTransport.create_group(n)``, or use
            ``ferrodist.testing.run_world``).
        timeout: how long every collective, barrier and receive may wait by default:
            seconds, or a ``datetime.timedelta``.
        init_timeout: how long this start may take: the ranks finding each other (ranks
            that a crowded machine starts seconds apart), this rank's shared-memory waits
            compiling or loading from Numba's cache, the two levels forming. Default:
            ``FERRODIST_INIT_TIMEOUT`` seconds if set, else the larger of ``timeout`` and
            60 s, so that a short ``timeout`` for the calls does not fail the start.
        transport: an already connected transport for this rank.
        debug: before every collective, check that all ranks are making the same call
            (operation, shape, dtype, op, root) and raise ``CollectiveMismatch`` listing
            what each rank called. Default: on when ``FERRODIST_DEBUG=detail``.
        cuda_route: how collectives on CUDA tensors run, for this group and the groups
            made from it: ``"auto"`` (default, or ``$FERRODIST_CUDA_ROUTE``): device to
            device through NCCL when every rank has a GPU of its own and NCCL loads, else
            staged through pinned host memory; ``"nccl"`` or ``"staged"`` force one. Every
            rank must ask for the same; the choice is made once, in the group's first
            collective on CUDA tensors, and logged.

    Returns:
        The world ``ProcessGroup``; module-level functions use it when ``group=None``.
    """
    timeout = seconds(timeout, "init_process_group")
    start_timeout = _init_timeout(init_timeout, timeout)
    if backend == "nccl":
        if cuda_route not in (None, "nccl"):
            raise InvalidArgument(
                f"init_process_group: backend='nccl' sends CUDA tensors through NCCL, but cuda_route={cuda_route!r}; "
                "pass one of them"
            )
        cuda_route = "nccl"
    route = requested_route(cuda_route, rank=rank)
    # Simulated ranks handed in as transports are threads of one process: each thread gets
    # its own default group. A world this call builds itself belongs to the whole process.
    threaded = transport is not None and transport.kind == "simulated"
    _check_not_initialized(threaded)  # before building a transport: every rank fails at once
    built, levels = transport is None, False
    if transport is None and replacements.is_replacement():
        return _replacement(timeout, start_timeout, debug, route)
    if transport is None:
        try:
            transport, levels = make_transport(backend, init_method, rank, world_size, timeout, start_timeout)
        except FerrodistError as exc:
            record_failure(exc)  # for the launcher: a peer that never arrived, or this rank's own error
            raise
    elif backend not in ("simulated", "auto", "nccl"):
        raise InvalidArgument(f"init_process_group: pass either backend={backend!r} or transport=, not both")
    if rank is not None and rank != transport.rank:
        raise InvalidRank(f"init_process_group: rank={rank} but the transport is rank {transport.rank}")
    if world_size is not None and world_size != transport.world_size:
        raise InvalidArgument(
            f"init_process_group: world_size={world_size} but the transport has {transport.world_size} ranks"
        )
    with _lock:
        try:
            _check_not_initialized(threaded)  # another thread may have been quicker
        except InvalidArgument:
            if built:
                transport.close()
            raise
        world = ProcessGroup(
            transport,
            range(transport.world_size),
            0,
            timeout=timeout,
            name="world",
            debug=enabled_by_environment() if debug is None else bool(debug),
            cuda_route=route,
        )
        if levels:
            _two_levels(world, start_timeout)
        if threaded:
            _thread_default.group = world
        else:
            _process_default.append(world)
    return world


def _replacement(timeout: float, start_timeout: float, debug: bool | None, route: str | None) -> ProcessGroup:
    """The default group of a process started in the place of a lost rank: the group of the
    running job that takes it in at its next commit point (see ``_failures.replacements``)."""
    try:
        transport, members, name = replacements.join(timeout, start_timeout)
    except FerrodistError as exc:
        record_failure(exc)
        raise
    world = ProcessGroup(
        transport,
        members,
        subgroup_channel(name),
        timeout=timeout,
        name=name,
        debug=enabled_by_environment() if debug is None else bool(debug),
        cuda_route=route,
        native=False,
    )
    with _lock:
        _process_default.append(world)
    return world


def _init_timeout(given: object, timeout: float) -> float:
    """Seconds the start may take (see ``init_process_group``)."""
    if given is not None:
        return seconds(given, "init_process_group (init_timeout)")
    named = os.environ.get("FERRODIST_INIT_TIMEOUT", "").strip()
    if named:
        try:
            return seconds(float(named), "init_process_group (FERRODIST_INIT_TIMEOUT)")
        except ValueError:
            raise InvalidArgument(
                f"init_process_group: FERRODIST_INIT_TIMEOUT={named!r} is not a number of seconds"
            ) from None
    return max(timeout, DEFAULT_INIT_TIMEOUT)


def _two_levels(world: ProcessGroup, start_timeout: float) -> None:
    """The world of a job over several nodes: its two levels (a collective of every rank,
    within the start's ``start_timeout``); on failure, the world is closed and the error raised."""
    try:
        levels.enable(world, start_timeout)
    except BaseException as exc:
        world._shutdown(1.0)
        world.transport.close()
        if isinstance(exc, FerrodistError):
            record_failure(exc)
        raise


def _check_not_initialized(threaded: bool) -> None:
    existing = getattr(_thread_default, "group", None) if threaded else next(iter(_process_default), None)
    if existing is not None:
        raise InvalidArgument(
            f"rank {existing.rank}: init_process_group: the default process group is already initialized "
            f"({existing.size} ranks over {type(existing.transport).__name__}); call destroy_process_group() first, "
            "or use the group you have",
            rank=existing.rank,
            operation="init_process_group",
        )


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or the default group and its transport (peers waiting on this
    rank then get ``PeerLost`` at once). Queued async work finishes first, for a few seconds at most."""
    if isinstance(group, _World):
        group = None
    if group is not None and group is not _current():
        resolve(group)._shutdown()
        return
    with _lock:
        world = getattr(_thread_default, "group", None)
        if world is not None:
            _thread_default.group = None
        elif _process_default:
            world = _process_default.pop()
    if world is None:
        raise NotInitialized("destroy_process_group: there is no default process group to destroy")
    world._shutdown()
    world.transport.close()


def new_group(
    ranks: Sequence[int] | None = None,
    *,
    timeout: float | timedelta | None = None,
    cuda_route: str | None = None,
) -> ProcessGroup:
    """A group of some of the world's ranks (global ranks; sorted, no duplicates), whose
    calls wait ``timeout`` (seconds or a ``timedelta``; default: the world's) by default
    and whose CUDA tensors take ``cuda_route`` (default: what the world asked for; see
    ``init_process_group``).

    Every rank of the world must call ``new_group`` with the same ranks, in the same
    order as its other ``new_group`` calls, members and non-members alike. A non-member
    gets a group it cannot run collectives on (``is_member`` is False).
    """
    world = default_group()
    limit = None if timeout is None else seconds(timeout, "new_group", rank=world.global_rank)
    size = world.size
    members = list(range(size)) if ranks is None else ranks
    try:
        chosen = sorted(int(r) for r in members)
    except (TypeError, ValueError):
        raise InvalidArgument(f"new_group: ranks must be a list of integers, not {ranks!r}") from None
    if len(set(chosen)) != len(chosen):
        raise InvalidArgument(f"new_group: ranks {list(members)} contain duplicates")
    if not chosen:
        raise InvalidArgument("new_group: ranks is empty; a group needs at least one rank")
    bad = [r for r in chosen if not 0 <= r < size]
    if bad:
        raise InvalidRank(f"new_group: ranks {bad} are outside the world of {size} ranks (valid: 0..{size - 1})")
    route = None if cuda_route is None else requested_route(cuda_route, rank=world.global_rank)
    return world._derive(chosen, limit, route)


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the default group if ``None``)."""
    return resolve(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (the default group if ``None``)."""
    return resolve(group).size


def backend_name(transport: Transport) -> str:
    """The name ``init_process_group`` knows ``transport``'s kind by."""
    return transport.kind


def get_backend(group: ProcessGroup | None = None) -> str:
    """The transport ``group`` runs over (the default group if ``None``): ``"simulated"``,
    ``"tcp"``, ``"shm"`` or ``"mpi"``; for a transport of your own, its class name; for a
    world whose collectives run over two levels (a job over several nodes), ``"levels"``.

    Example::

        init_process_group("auto")   # under `ferrodist run -n 2` on one host
        get_backend()                # "shm"
    """
    found = resolve(group)
    return "levels" if found._route.levels is not None else backend_name(found.transport)


def is_available() -> bool:
    """True: the collectives are installed and usable in this process (as
    ``torch.distributed.is_available``; the backends each need is said by ``init_process_group``)."""
    return True
