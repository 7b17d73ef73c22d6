"""``validate`` and ``simulate``: run every rank's steps symbolically, before any data moves.

They run the lowered lists (``_lower``), the same steps the engine runs: the compute
actions with the messages they imply. A receive waits for its send; sends are buffered,
as the engine's are, so a schedule is runnable exactly when this execution finishes
every list; when it stops first, the error names each stuck rank, the action it is stuck
at and the action it waits for. Each rank's list is first checked on its own: every
action once, each after the ones it needs on that rank (B after F, W after B).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferrodist.core import BackendUnavailable, InvalidArgument

from ._actions import Action, Schedule, count
from ._lower import RECV, SEND, Step, lower_actions

__all__ = ["ScheduleError", "Slot", "Timeline", "simulate", "validate"]

Costs = Mapping[str, float] | Callable[[Action, int], float] | None


class ScheduleError(InvalidArgument):
    """A schedule that cannot run: an action missing, repeated or out of order, or a deadlock."""


@dataclass(frozen=True)
class Slot:
    """One action on the timeline: when it runs, on which rank, for which model stage."""

    rank: int
    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What ``simulate`` returns: every rank's slots and the figures of the schedule."""

    schedule: str
    n_ranks: int
    n_microbatches: int
    slots: tuple[tuple[Slot, ...], ...]
    makespan: float
    #: idle time over all ranks divided by ranks x makespan
    bubble_fraction: float
    #: per rank, the most micro-batch chunks whose forward ran and whose W (or BW) had not
    peak_activations: tuple[int, ...]

    def render_text(self) -> str:
        """One row per rank, one column per unit of the cheapest action (as in the papers);
        ``.`` is idle time. Labels are kind and micro-batch, ``.c`` for chunk c > 0."""
        every = [s for row in self.slots for s in row]
        unit = min((s.end - s.start for s in every if s.end > s.start), default=1.0)
        width = max((len(str(s.action)) for s in every), default=2) + 1
        columns = round(self.makespan / unit)
        lines = [
            f"{self.schedule}: {self.n_ranks} ranks, {self.n_microbatches} micro-batches, "
            f"bubble {self.bubble_fraction:.1%}, peak activations {list(self.peak_activations)}"
        ]
        for rank, row in enumerate(self.slots):
            cells = [".".ljust(width)] * columns
            for slot in row:
                first, last = round(slot.start / unit), max(round(slot.end / unit), round(slot.start / unit) + 1)
                label = str(slot.action)
                for col in range(first, min(last, columns)):
                    cells[col] = (label if col == first else "").ljust(width)
            lines.append(f"rank {rank} |{''.join(cells).rstrip()}")
        return "\n".join(lines)

    def render_png(self, path: str) -> None:
        """Draw the timeline into a PNG file (needs matplotlib: ``pip install matplotlib``)."""
        import matplotlib.pyplot as plt

        fig = self.figure()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def figure(self) -> Any:
        """The timeline as a matplotlib figure: one row per rank, one bar per action, coloured
        by kind, with a legend of the kinds (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise BackendUnavailable("Timeline.render_png needs matplotlib: pip install matplotlib") from exc
        colours = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#c44e52"}
        fig, ax = plt.subplots(figsize=(max(6.0, self.makespan * 0.35), 0.6 * self.n_ranks + 1.2))
        for rank, row in enumerate(self.slots):
            for slot in row:
                ax.broken_barh(
                    [(slot.start, slot.end - slot.start)],
                    (rank - 0.4, 0.8),
                    facecolors=colours[slot.action.kind],
                    edgecolor="white",
                )
                ax.text(
                    (slot.start + slot.end) / 2,
                    rank,
                    str(slot.action),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        ax.set_yticks(range(self.n_ranks), [f"rank {r}" for r in range(self.n_ranks)])
        ax.invert_yaxis()
        names = {"F": "forward", "B": "backward (input)", "W": "backward (weights)", "BW": "backward"}
        kinds = sorted({slot.action.kind for row in self.slots for slot in row}, key=list(colours).index)
        handles = [plt.Rectangle((0, 0), 1, 1, facecolor=colours[k]) for k in kinds]
        ax.legend(handles, [f"{k}: {names[k]}" for k in kinds], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        ax.set_xlabel("time")
        ax.set_title(f"{self.schedule}: bubble {self.bubble_fraction:.1%}")
        fig.tight_layout()
        return fig


def validate(schedule: Schedule, n_ranks: int, n_microbatches: int) -> None:
    """Prove that ``schedule`` runs to the end on ``n_ranks`` ranks with ``n_microbatches``
    micro-batches: every action present once, in a possible order, and no deadlock.

    Raises:
        ScheduleError: what is wrong, on which rank, at which action.
    """
    _run(schedule, n_ranks, n_microbatches, None)


def simulate(schedule: Schedule, n_ranks: int, n_microbatches: int, costs: Costs = None) -> Timeline:
    """Run ``schedule`` on a clock: each action starts when its rank is free and what it
    needs has finished (messages take no time).

    Args:
        costs: None (F = B = W = 1, BW = B + W); a mapping with some of "F", "B", "W", "BW";
            or ``costs(action, stage) -> float`` (e.g. stages of different sizes).

    Raises:
        ScheduleError: as ``validate``.
    """
    return _run(schedule, n_ranks, n_microbatches, _cost_function(costs))


def _cost_function(costs: Costs) -> Callable[[Action, int], float]:
    if callable(costs):
        return costs
    table = {"F": 1.0, "B": 1.0, "W": 1.0}
    if costs is not None:
        unknown = set(costs) - {"F", "B", "W", "BW"}
        if unknown:
            raise InvalidArgument(f"simulate: costs has unknown kinds {sorted(unknown)} (use F, B, W, BW)")
        table.update({k: float(v) for k, v in costs.items()})
    table.setdefault("BW", table["B"] + table["W"])
    if any(not value >= 0 for value in table.values()):
        raise InvalidArgument(f"simulate: costs must be >= 0, not {table}")
    return lambda action, stage: table[action.kind]


def _run(
    schedule: Schedule, n_ranks: int, n_microbatches: int, cost: Callable[[Action, int], float] | None
) -> Timeline:
    if not isinstance(schedule, Schedule):
        raise InvalidArgument(f"expected a Schedule (GPipe(), OneFOneB(), ...), not {type(schedule).__name__}")
    p = count("n_ranks", n_ranks)
    m = count("n_microbatches", n_microbatches)
    return _execute(schedule, schedule.all_actions(p, m), p, m, cost)


def runs(schedule: Schedule, lists: Sequence[Sequence[Action]], p: int) -> bool:
    """Whether these lists (the whole step, every rank) run to the end."""
    m = 1 + max(a.microbatch for actions in lists for a in actions)
    try:
        _execute(schedule, [list(a) for a in lists], p, m, None)
    except ScheduleError:
        return False
    return True


def _execute(
    schedule: Schedule, lists: list[list[Action]], p: int, m: int, cost: Callable[[Action, int], float] | None
) -> Timeline:
    """Run the lowered lists (``_lower``: what the engine runs) on a clock: a compute step
    takes its cost once its rank is free; a send takes no time and never waits; a receive
    waits for its send."""
    for rank, actions in enumerate(lists):
        _check_list(schedule, rank, actions, p, m)
    steps = [lower_actions(actions, rank, p, schedule.chunks) for rank, actions in enumerate(lists)]
    sent_at: dict[tuple[bool, int, int], float] = {}  # message -> when its send ran
    sender: dict[tuple[bool, int, int], tuple[int, int]] = {}  # message -> (rank, action index) sending it
    for rank, row in enumerate(steps):
        for step in row:
            if step.kind == SEND:
                sender[step.message] = (rank, step.index)
    pos, clock = [0] * p, [0.0] * p
    rows: list[list[Slot]] = [[] for _ in range(p)]
    while True:
        progressed = False
        for rank in range(p):
            row = steps[rank]
            while pos[rank] < len(row):
                step = row[pos[rank]]
                if step.kind == RECV:
                    if step.message not in sent_at:
                        break
                    clock[rank] = max(clock[rank], sent_at[step.message])
                elif step.kind == SEND:
                    sent_at[step.message] = clock[rank]
                else:
                    start = clock[rank]
                    clock[rank] = start + (cost(step.action, step.stage) if cost is not None else 1.0)
                    rows[rank].append(Slot(rank, step.stage, step.action, start, clock[rank]))
                pos[rank] += 1
                progressed = True
        if all(pos[r] == len(steps[r]) for r in range(p)):
            break
        if not progressed:
            raise ScheduleError(_deadlock(schedule, steps, pos, sender))
    makespan = max(clock)
    busy = sum(slot.end - slot.start for row in rows for slot in row)
    return Timeline(
        schedule=repr(schedule),
        n_ranks=p,
        n_microbatches=m,
        slots=tuple(tuple(row) for row in rows),
        makespan=makespan,
        bubble_fraction=1.0 - busy / (p * makespan) if makespan > 0 else 0.0,
        peak_activations=tuple(_peak(actions) for actions in lists),
    )


def _check_list(schedule: Schedule, rank: int, actions: list[Action], p: int, m: int) -> None:
    """Every (micro-batch, chunk) once: an F, then a BW or a B then a W, in that order."""
    seen: dict[tuple[int, int], list[str]] = {}
    for a in actions:
        if a.chunk >= schedule.chunks:
            raise ScheduleError(
                f"{schedule!r}, rank {rank}: {a} names chunk {a.chunk}, but each rank holds {schedule.chunks}"
            )
        if a.microbatch >= m:
            raise ScheduleError(f"{schedule!r}, rank {rank}: {a} names micro-batch {a.microbatch}, but a step has {m}")
        kinds = seen.setdefault((a.microbatch, a.chunk), [])
        if a.kind in kinds or (a.kind == "BW" and {"B", "W"} & set(kinds)) or ("BW" in kinds and a.kind in "BW"):
            raise ScheduleError(f"{schedule!r}, rank {rank}: {a} appears twice (or both fused and split)")
        if a.kind != "F" and "F" not in kinds:
            raise ScheduleError(f"{schedule!r}, rank {rank}: {a} comes before its forward F{_suffix(a)}")
        if a.kind == "W" and "B" not in kinds:
            raise ScheduleError(f"{schedule!r}, rank {rank}: {a} comes before its input gradient B{_suffix(a)}")
        kinds.append(a.kind)
    for chunk in range(schedule.chunks):
        stage = schedule.stage(rank, chunk, p)
        for i in range(m):
            kinds = seen.get((i, chunk), [])
            label = f"{i}" + (f".{chunk}" if chunk else "")
            if "F" not in kinds:
                fate = (
                    f"stage {stage - 1}'s output for micro-batch {i} would never be received"
                    if stage > 0
                    else f"micro-batch {i} would never enter the pipeline"
                )
                raise ScheduleError(f"{schedule!r}, rank {rank}: no F{label}: {fate}")
            if "BW" not in kinds and ("B" not in kinds or "W" not in kinds):
                missing = "BW" + label if not {"B", "W"} & set(kinds) else ("W" if "B" in kinds else "B") + label
                raise ScheduleError(f"{schedule!r}, rank {rank}: no {missing} for micro-batch {i} of chunk {chunk}")


def _suffix(a: Action) -> str:
    return f"{a.microbatch}" + (f".{a.chunk}" if a.chunk else "")


def _deadlock(
    schedule: Schedule,
    steps: list[list[Step]],
    pos: list[int],
    sender: dict[tuple[bool, int, int], tuple[int, int]],
) -> str:
    """Each stuck rank: the action whose message it waits for, and where the rank that
    would send it is stuck (only receives wait)."""
    parts = []
    for rank, row in enumerate(steps):
        if pos[rank] == len(row):
            continue
        step = row[pos[rank]]
        gradient, i, boundary = step.message
        needed = f"B{i} of stage {boundary + 1}" if gradient else f"F{i} of stage {boundary}"
        where = f"rank {rank} at its action #{step.index} ({step.action}, stage {step.stage}) waits for {needed}"
        if step.message not in sender:
            parts.append(f"{where}, which no rank sends")
            continue
        owner, index = sender[step.message]
        blocker = steps[owner][pos[owner]] if pos[owner] < len(steps[owner]) else None
        at = blocker.index if blocker is not None else len(steps[owner])
        parts.append(
            f"{where} (rank {owner}'s action #{index}), which rank {owner} has not reached: it is stuck at #{at} "
            f"({blocker.action if blocker is not None else None})"
        )
    return f"{schedule!r} deadlocks: " + "; ".join(parts)


def _peak(actions: list[Action]) -> int:
    held = peak = 0
    for a in actions:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind in ("W", "BW"):
            held -= 1
    return peak
