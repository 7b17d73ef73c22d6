"""Faults to inject into a simulated world, so failure paths are tested deterministically."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ferrodist.core import InvalidArgument

__all__ = ["Faults"]


@dataclass(frozen=True)
class Faults:
    """What goes wrong, and when, in a ``SimulatedTransport`` world.

    Attributes:
        delay: rank -> seconds that rank sleeps before each message it sends (a slow rank).
        die_at: rank -> n: that rank dies when it tries to send its n-th message (counting
            from 1): its transport closes as if the process were killed, the send raises
            ``PeerLost`` in that rank, and its peers get ``PeerLost`` naming it.
        silent_at: rank -> n: from its n-th message on, that rank's messages are lost
            while it stays alive (a rank that drops out of a collective): its peers time out.

    Example:
        >>> world = SimulatedTransport.create_group(4, faults=Faults(die_at={2: 3}))
    """

    delay: Mapping[int, float] = field(default_factory=dict)
    die_at: Mapping[int, int] = field(default_factory=dict)
    silent_at: Mapping[int, int] = field(default_factory=dict)

    def check(self, world_size: int) -> None:
        for name, table in (("delay", self.delay), ("die_at", self.die_at), ("silent_at", self.silent_at)):
            for rank, value in table.items():
                if not 0 <= rank < world_size:
                    raise InvalidArgument(f"Faults.{name}: rank {rank} is not in a world of {world_size}")
                if value < (0 if name == "delay" else 1):
                    raise InvalidArgument(f"Faults.{name}[{rank}] = {value!r} is out of range")
