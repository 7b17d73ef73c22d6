"""Schedules as data: per-rank ordered lists of actions that the engine only executes.

A pipeline of ``n_ranks`` ranks runs ``n_microbatches`` micro-batches through
``n_ranks * chunks`` model stages: chunk ``c`` on rank ``r`` is stage ``c * n_ranks + r``
(Megatron's looping placement; one chunk per rank unless interleaved). An action is a
forward (F), a backward for the input (B), a backward for the weights (W), or both
backwards fused (BW) of one micro-batch on one chunk. What goes over the wire follows from
the actions: F of stage s sends its output to stage s+1, B (or BW) of stage s sends the
gradient of its input to stage s-1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ferrodist.core import InvalidArgument

__all__ = ["KINDS", "Action", "Schedule", "count"]

KINDS = ("F", "B", "W", "BW")
_ACTION = re.compile(r"(BW|F|B|W)([0-9]+)(?:\.([0-9]+))?")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: ``kind`` (F, B, W or BW) of ``microbatch`` on local ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"Action: kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        for name in ("microbatch", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"Action: {name} must be an integer >= 0, not {value!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``str`` prints: ``'F3'`` is ``Action('F', 3)``, ``'BW1.2'`` is
        ``Action('BW', 1, 2)`` (``'F3.0'`` is read as ``'F3'``)."""
        match = _ACTION.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise InvalidArgument(
                f"Action.parse: cannot read action {text!r}: write the kind (F, B, W or BW), the micro-batch and, "
                "for a chunk other than 0, a dot and the chunk ('F3', 'B2', 'W0', 'BW1.1')"
            )
        kind, micro, chunk = match.groups()
        return cls(kind, int(micro), int(chunk) if chunk else 0)


def count(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgument(f"{name} must be an integer >= {low}, not {value!r}")
    return value


class Schedule:
    """The order of actions on every rank. Subclasses implement ``_lists``."""

    #: model chunks per rank (virtual stages); the stage module list on a rank has this length
    chunks: int = 1

    def actions(self, rank: int, n_ranks: int, n_microbatches: int) -> list[Action]:
        """This rank's ordered actions for one training step."""
        lists = self.all_actions(n_ranks, n_microbatches)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n_ranks:
            raise InvalidArgument(f"{self!r}.actions: rank must be in 0..{n_ranks - 1}, not {rank!r}")
        return list(lists[rank])

    def all_actions(self, n_ranks: int, n_microbatches: int) -> list[list[Action]]:
        """Every rank's list (rank order)."""
        p = count(f"{self!r}: n_ranks", n_ranks)
        m = count(f"{self!r}: n_microbatches", n_microbatches)
        return [list(actions) for actions in self._lists(p, m)]

    def _lists(self, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
        raise NotImplementedError

    def stage(self, rank: int, chunk: int, n_ranks: int) -> int:
        """The model stage that ``chunk`` of ``rank`` holds."""
        return chunk * n_ranks + rank

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(repr(self))
