"""Collectives over two levels, as data: shared memory inside a node, the network between.

A job that spans nodes places its ranks on them (``Nodes``: each node's global ranks, in
local-rank order; nodes may hold different numbers of ranks). Its all_reduce of ``count``
elements goes in three steps (``levels_plan``), as Open MPI's hierarchical collectives,
NCCL's trees and Horovod's hierarchical allreduce do:

1. inside each node, a reduce-scatter: the tensor is cut into as many shards as the
   largest node has ranks, and local rank j of a node of L ranks is given the node's sum
   of shards j, j + L, j + 2L, ...;
2. across nodes, one all_reduce per shard among its owners (one rank per node), so every
   rank of a node drives a network stream of its own and all of them use the link at once;
3. inside each node, an all-gather: every rank gets every shard.

Each rank sends 2 (N - 1) / N of its shards over the network (N nodes) instead of a flat
ring's 2 (P - 1) / P of the whole tensor (P ranks). A plan is a plain value computed from
(nodes, count, rank), printable, and checked against the flat all_reduce without moving a
byte (tests/collectives/test_levels.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ferrodist.collectives._algorithms.plans import chunk_layout
from ferrodist.core import InvalidArgument

__all__ = ["LevelsPlan", "Nodes", "levels_plan"]


@dataclass(frozen=True)
class Nodes:
    """Where a job's ranks run: ``members[k]`` are node k's global ranks, local rank order;
    ``hosts[k]`` what node k is (host name and boot id), when known."""

    members: tuple[tuple[int, ...], ...]
    hosts: tuple[str, ...] = ()

    @classmethod
    def from_places(cls, places: Sequence[tuple[int, int]]) -> Nodes:
        """``places[r] = (node, local rank)`` of global rank r, as the launchers say
        (``GROUP_RANK``/``NODE_RANK`` and ``LOCAL_RANK``). Nodes are numbered from 0
        without gaps and each node's local ranks from 0 without gaps or repeats."""
        if not places:
            raise InvalidArgument("Nodes.from_places: a job has at least one rank")
        count = max(node for node, _ in places) + 1
        members: list[dict[int, int]] = [{} for _ in range(count)]
        for rank, (node, local) in enumerate(places):
            if node < 0 or local < 0:
                raise InvalidArgument(f"Nodes.from_places: rank {rank} is at node {node}, local rank {local}")
            if local in members[node]:
                raise InvalidArgument(
                    f"Nodes.from_places: ranks {members[node][local]} and {rank} both say they are local rank "
                    f"{local} of node {node}"
                )
            members[node][local] = rank
        for node, locals_ in enumerate(members):
            if not locals_:
                raise InvalidArgument(
                    f"Nodes.from_places: no rank is on node {node}, yet ranks are on node {count - 1}: "
                    "nodes are numbered from 0 without gaps"
                )
            if sorted(locals_) != list(range(len(locals_))):
                raise InvalidArgument(
                    f"Nodes.from_places: node {node} has local ranks {sorted(locals_)}, not 0 to {len(locals_) - 1}"
                )
        return cls(tuple(tuple(m[j] for j in range(len(m))) for m in members))

    @property
    def world_size(self) -> int:
        return sum(len(m) for m in self.members)

    def ranks_on_host(self, node: int) -> int:
        """How many ranks run on node ``node``'s host: its own, and those of the nodes on the
        same host (a launcher may start several nodes on one machine, as tests do)."""
        if not self.hosts:
            return len(self.members[node])
        here = self.hosts[node]
        return sum(len(m) for m, host in zip(self.members, self.hosts, strict=True) if host == here)

    def place(self, rank: int) -> tuple[int, int]:
        """(node, local rank) of global ``rank``."""
        for node, ranks in enumerate(self.members):
            if rank in ranks:
                return node, ranks.index(rank)
        raise InvalidArgument(f"rank {rank} is on none of the job's {len(self.members)} nodes")

    def __str__(self) -> str:
        return ", ".join(f"node {k}: ranks {list(m)}" for k, m in enumerate(self.members))


@dataclass(frozen=True)
class LevelsPlan:
    """One rank's part of a two-level all_reduce (see the module's docstring).

    ``counts[s]``/``offsets[s]`` lay out the shards; ``node_ranks`` are this node's ranks,
    which reduce-scatter and all-gather together; ``owned`` are the shards this rank
    reduces across nodes, ``across[i]`` the ranks (one per node, in node order) it
    all_reduces ``owned[i]`` with; ``owners[s]`` is the rank of this node that owns shard s.
    """

    rank: int
    node: int
    local: int
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    node_ranks: tuple[int, ...]
    owners: tuple[int, ...]
    owned: tuple[int, ...]
    across: tuple[tuple[int, ...], ...]

    def span(self, shard: int) -> slice:
        return slice(self.offsets[shard], self.offsets[shard] + self.counts[shard])

    def network_elements(self) -> float:
        """Elements this rank sends between nodes (ring all_reduce of each owned shard)."""
        return sum(
            2 * (len(group) - 1) / len(group) * self.counts[s] for s, group in zip(self.owned, self.across, strict=True)
        )

    def __str__(self) -> str:
        shards = ", ".join(f"{s} with ranks {list(g)}" for s, g in zip(self.owned, self.across, strict=True))
        return (
            f"rank {self.rank} (node {self.node}, local rank {self.local} of {len(self.node_ranks)}): "
            f"{len(self.counts)} shards; reduce-scatter and all-gather with ranks {list(self.node_ranks)}; "
            f"across nodes: shard {shards or 'none'}"
        )


def levels_plan(nodes: Nodes, count: int, rank: int) -> LevelsPlan:
    """Rank ``rank``'s plan for a two-level all_reduce of ``count`` elements over ``nodes``."""
    node, local = nodes.place(rank)
    shards = max(len(m) for m in nodes.members)
    counts, offsets = chunk_layout(count, shards)
    mine = nodes.members[node]
    owned = tuple(s for s in range(shards) if s % len(mine) == local)
    across = tuple(tuple(m[s % len(m)] for m in nodes.members) for s in owned)
    return LevelsPlan(
        rank=rank,
        node=node,
        local=local,
        counts=counts,
        offsets=offsets,
        node_ranks=mine,
        owners=tuple(mine[s % len(mine)] for s in range(shards)),
        owned=owned,
        across=across,
    )
