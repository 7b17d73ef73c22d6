"""Where one launcher's ranks sit in a job of one or several nodes."""

from __future__ import annotations

from dataclasses import dataclass

from ferrodist.launch._nodes.channel import rank_token
from ferrodist.launch._nodes.judge import Node

__all__ = ["Placement", "place"]


@dataclass(frozen=True)
class Placement:
    """Where this launcher's ranks sit in the job, and what every rank is told."""

    node_rank: int
    nnodes: int
    first_rank: int
    local_size: int
    world_size: int
    master_addr: str
    master_port: int
    token: str
    job: str
    nodes: tuple[Node, ...] = ()
    #: which start of the job this is (0, then one more at each restart), as node 0 says
    attempt: int = 0


def place(
    nodes: tuple[Node, ...], node_rank: int, addr: str, port: int, token: str, job: str, attempt: int = 0
) -> Placement:
    """The placement of node ``node_rank``'s ranks in a job of ``nodes``."""
    me = nodes[node_rank]
    world = sum(n.count for n in nodes)
    token = rank_token(token, job)
    return Placement(node_rank, len(nodes), me.first, me.count, world, addr, port, token, job, nodes, attempt)
