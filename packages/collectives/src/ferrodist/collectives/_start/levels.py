"""Starting the two levels of a world (``_levels.run``): from the launchers' placement, or
from places and node transports given (simulated nodes), agreed over the world before any
rank switches, and attached to the world's route and abort watcher."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ferrodist.collectives._composed.objects import all_gather_object
from ferrodist.collectives._levels.plan import Nodes
from ferrodist.collectives._levels.run import Levels
from ferrodist.core import FerrodistError, InvalidArgument
from ferrodist.transport import ShmTransport, Store, Transport, this_host

if TYPE_CHECKING:
    from ferrodist.collectives._group import ProcessGroup

__all__ = ["NODE_VARIABLES", "attach", "discover_nodes", "enable", "enable_given"]

#: Where launchers say which node a rank runs on: ferrodist run and torchrun, then SLURM.
NODE_VARIABLES = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")

_log = logging.getLogger("ferrodist.collectives")
#: The longest a node's ranks wait for each other to open their shared memory, unless the
#: start is given longer.
_NODE_START = 120.0


def enable_given(
    world: ProcessGroup, places: Sequence[tuple[int, int]] | None, node_transport: Transport | None
) -> str | None:
    """``enable_two_levels`` on ``world`` (see there): found by the ranks, or from the places
    and node transport given."""
    transport = world.transport
    operation = "enable_two_levels"
    if list(world.ranks) != list(range(transport.world_size)):
        raise InvalidArgument(
            f"rank {world.global_rank}: {operation}: only the world group runs over two levels, not group {world.name}",
            rank=world.global_rank,
            operation=operation,
        )
    if world._route.levels is not None:
        return str(world._route.levels)
    if places is None:
        if node_transport is not None:
            raise InvalidArgument(f"rank {world.global_rank}: {operation}: node_transport= needs places=")
        found = enable(world)
        return None if found is None else str(found)
    nodes, why = _given(world, places, node_transport)
    said: list[tuple[str, Any]] = [("", None)] * world.size
    all_gather_object(world, said, (why, None if nodes is None else nodes.members))
    bad = next(((rank, text) for rank, (text, _) in enumerate(said) if text), None)
    if bad is None and any(members != said[0][1] for _, members in said):
        bad = next(
            (rank, f"its places {members} differ from rank 0's {said[0][1]}")
            for rank, (_, members) in enumerate(said)
            if members != said[0][1]
        )
    if bad is not None:
        rank, text = bad
        raise InvalidArgument(
            f"rank {world.global_rank}: {operation}: "
            + (text if rank == world.global_rank else f"rank {rank}: {text}")
            + "; every rank stays flat",
            rank=world.global_rank,
            operation=operation,
        )
    assert nodes is not None
    node, _ = nodes.place(world.global_rank)
    size = len(nodes.members[node])
    levels = Levels(nodes, transport, world._runner.group_id, node_transport if size > 1 else None)
    attach(world, levels)
    return str(levels)


def _given(
    world: ProcessGroup, places: Sequence[tuple[int, int]], node_transport: Transport | None
) -> tuple[Nodes | None, str]:
    """The nodes ``places`` describe, or why they (or ``node_transport``) do not fit this rank."""
    try:
        nodes = Nodes.from_places(list(places))
    except InvalidArgument as exc:
        return None, str(exc)
    if nodes.world_size != world.size:
        return nodes, f"places lists {nodes.world_size} ranks, the world has {world.size}"
    node, local = nodes.place(world.global_rank)
    size = len(nodes.members[node])
    if size > 1 and (node_transport is None or (node_transport.rank, node_transport.world_size) != (local, size)):
        given = "None" if node_transport is None else f"rank {node_transport.rank} of {node_transport.world_size}"
        return nodes, (
            f"this rank is local rank {local} of the {size} ranks of node {node}: node_transport must be that "
            f"rank of {size}, not {given}"
        )
    return nodes, ""


def enable(world: ProcessGroup, start_timeout: float | None = None) -> Levels | None:
    """Give ``world`` (the world group of a job over tcp) its two levels when its ranks span
    several nodes and some node runs more than one: every rank learns where the ranks run
    (``discover_nodes``), the ranks of each node open their shared memory through the
    world's store, and all of them agree (a rank that could not makes every rank stay flat,
    with a warning naming it). A collective of every rank, whose waits (a node's shared
    memory opening, its waits compiling) may take ``start_timeout`` (default: the world's
    timeout); returns the levels, or None."""
    start = world.timeout if start_timeout is None else start_timeout
    nodes = discover_nodes(world, timeout=start)
    if len(nodes.members) < 2 or max(len(m) for m in nodes.members) < 2:
        _log.info("rank %d: %s: one rank per node, or one node: no second level", world.rank, nodes)
        return None
    node, local = nodes.place(world.rank)
    size = len(nodes.members[node])
    inner: ShmTransport | None = None
    why = ""
    store = world.transport.store
    if size > 1 and store is None:
        why = f"the world's {world.transport.kind} transport has no store for the node's ranks to meet through"
    elif size > 1 and store is not None:
        try:
            inner = ShmTransport.connect(
                rank=local,
                world_size=size,
                master_addr="127.0.0.1",
                rendezvous=_Prefixed(store, f"ferrodist/levels/node{node}/", start),
                timeout=min(world.timeout, _NODE_START),
                start_timeout=max(start, min(world.timeout, _NODE_START)),
            )
        except FerrodistError as exc:
            why = f"{type(exc).__name__}: {exc}"
    said: list[str] = [""] * world.size
    all_gather_object(world, said, why, timeout=start)
    failed = [(rank, text) for rank, text in enumerate(said) if text]
    if failed:
        if inner is not None:
            inner.close()
        rank, text = failed[0]
        _log.warning(
            "rank %d: the job spans %d nodes, but rank %d could not open its node's shared memory (%s): every "
            "collective runs over tcp",
            world.rank,
            len(nodes.members),
            rank,
            text,
        )
        return None
    ranks = nodes.ranks_on_host(node)  # nodes of this job on one host (a test's, say) share its cores
    world.transport.share_host(ranks)
    if inner is not None:
        inner.share_host(ranks)
    levels = Levels(nodes, world.transport, world._runner.group_id, inner, nodes.hosts)
    attach(world, levels)
    return levels


def attach(world: ProcessGroup, levels: Levels) -> None:
    """Run ``world``'s collectives over ``levels`` from its next call on; its aborts reach the
    node's steps (``Levels.bridge``)."""
    world._runner.first_on_abort(levels.bridge)
    world._route.use_levels(levels)
    _log.info("rank %d: %s", world.rank, levels)


class _Prefixed:
    """The world's store seen by one node: every key under ``prefix``."""

    def __init__(self, store: Store, prefix: str, timeout: float) -> None:
        self._store, self._prefix, self._timeout = store, prefix, timeout

    def get(self, key: str) -> bytes:
        value: bytes = self._store.get(self._prefix + key, timeout=self._timeout)
        return value

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._prefix + key, value)


def discover_nodes(
    group: ProcessGroup, env: Mapping[str, str] | None = None, host: str | None = None, timeout: float | None = None
) -> Nodes:
    """Which node each rank of ``group`` runs on, the same answer on every rank (a collective).

    The launcher's node number where every rank has one (``GROUP_RANK`` or ``NODE_RANK``
    from ``ferrodist run`` and torchrun, ``SLURM_NODEID``; each rank reads the first that is
    set in ``env``, this process's environment by default), else the host each rank runs
    on (``this_host()``, or ``host``). Nodes are numbered in the order of their first rank,
    and a node's local ranks in the order of their global ranks. ``timeout``: the
    collective's (default: the group's).
    """
    env = os.environ if env is None else env
    node = next((env[name] for name in NODE_VARIABLES if env.get(name, "").strip()), None)
    everyone: list[tuple[str | None, str]] = [("", "")] * group.size
    all_gather_object(group, everyone, (node, host if host is not None else this_host()), timeout=timeout)
    by_launcher = all(mine is not None for mine, _ in everyone)
    keys = [str(mine) if by_launcher else where for mine, where in everyone]
    numbers: dict[str, int] = {}
    places: list[tuple[int, int]] = []
    seen: dict[int, int] = {}
    hosts: list[str] = []
    for key, (_, where) in zip(keys, everyone, strict=True):
        k = numbers.setdefault(key, len(numbers))
        if k == len(hosts):
            hosts.append(where)
        places.append((k, seen.get(k, 0)))
        seen[k] = seen.get(k, 0) + 1
    return dataclasses.replace(Nodes.from_places(places), hosts=tuple(hosts))
