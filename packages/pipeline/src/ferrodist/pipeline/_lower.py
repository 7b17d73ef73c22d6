"""Lowering: a schedule's compute actions, with the messages they imply made explicit.

A schedule says only what each rank computes (F, B, W, BW of a micro-batch on a chunk).
``lower`` turns each rank's list into the steps the engine runs and ``validate`` and
``simulate`` read, so the two can never disagree about what travels:

- before F of stage s > 0: receive its input, the activation stage s - 1 sent;
- after F of stage s < last: send its output to stage s + 1;
- before B (or BW) of stage s < last: receive the gradient of its output from stage s + 1;
- after B (or BW) of stage s > 0: send the gradient of its input to stage s - 1.

W sends and receives nothing. A message whose two stages are on one rank (a pipeline of
one rank, or chunks of an interleaved schedule) is a step like any other: its send comes
before its receive in that rank's list, or the schedule deadlocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._actions import Action, Schedule

__all__ = ["Step", "lower", "lower_actions"]

#: The kinds of the message steps (compute steps have their action's kind).
SEND, RECV = "send", "recv"


@dataclass(frozen=True)
class Step:
    """One step of one rank: a compute action, or a message that one implies.

    Attributes:
        kind: ``"F"``, ``"B"``, ``"W"`` or ``"BW"`` (compute), ``"send"`` or ``"recv"``.
        action: the compute action the step is (or belongs to).
        index: that action's place in the rank's list of actions.
        stage: the model stage of the action.
        peer: the rank at the other end of a message (None for compute).
        boundary: the boundary a message crosses, between stages ``boundary`` and
            ``boundary + 1`` (None for compute).
        gradient: whether a message carries a gradient (backward) or an activation.
    """

    kind: str
    action: Action
    index: int
    stage: int
    peer: int | None = None
    boundary: int | None = None
    gradient: bool = False

    @property
    def message(self) -> tuple[bool, int, int]:
        """What a message step moves: (gradient, micro-batch, boundary); its send and its
        receive have the same."""
        assert self.boundary is not None, "a compute step moves no message"
        return self.gradient, self.action.microbatch, self.boundary

    def __str__(self) -> str:
        if self.boundary is None:
            return str(self.action)
        what = "gradient" if self.gradient else "activation"
        way = "to" if self.kind == SEND else "from"
        return f"{self.kind} {what} {self.action.microbatch} {way} rank {self.peer} (boundary {self.boundary})"


def lower_actions(actions: Sequence[Action], rank: int, n_ranks: int, chunks: int) -> list[Step]:
    """One rank's steps: ``actions`` (that rank's, in order) with their messages."""
    last = n_ranks * chunks - 1
    steps: list[Step] = []
    for index, a in enumerate(actions):
        s = a.chunk * n_ranks + rank
        if a.kind == "F" and s > 0:
            steps.append(Step(RECV, a, index, s, (s - 1) % n_ranks, s - 1))
        elif a.kind in ("B", "BW") and s < last:
            steps.append(Step(RECV, a, index, s, (s + 1) % n_ranks, s, gradient=True))
        steps.append(Step(a.kind, a, index, s))
        if a.kind == "F" and s < last:
            steps.append(Step(SEND, a, index, s, (s + 1) % n_ranks, s))
        elif a.kind in ("B", "BW") and s > 0:
            steps.append(Step(SEND, a, index, s, (s - 1) % n_ranks, s - 1, gradient=True))
    return steps


def lower(schedule: Schedule, n_ranks: int, n_microbatches: int) -> list[list[Step]]:
    """Every rank's steps for one training step of ``schedule`` (rank order).

    Example::

        >>> [str(step) for step in lower(GPipe(), 2, 1)[1]]
        ['recv activation 0 from rank 0 (boundary 0)', 'F0', 'BW0', 'send gradient 0 to rank 0 (boundary 0)']
    """
    lists = schedule.all_actions(n_ranks, n_microbatches)
    return [lower_actions(actions, rank, n_ranks, schedule.chunks) for rank, actions in enumerate(lists)]
