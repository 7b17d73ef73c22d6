"""ferrodist.pipeline: pipeline parallelism over any group. Schedules are data (GPipe,
1F1B, interleaved 1F1B, zero-bubble ZB-H1) that ``validate`` proves deadlock-free and
``simulate`` turns into a timeline, all three reading the same lowered steps (``lower``:
the compute actions with the messages they imply); ``Pipeline`` runs one, sending each stage's input
gradient backward, so every stage's gradients equal the unsplit model's."""

from ._actions import Action, Schedule
from ._check import ScheduleError, Slot, Timeline, simulate, validate
from ._lower import Step, lower
from ._pipeline import Pipeline
from ._schedules import CustomSchedule, GPipe, Interleaved1F1B, OneFOneB, ZeroBubbleH1
from ._split import split_sequential
from ._stages import Stage

__all__ = [
    "Action",
    "CustomSchedule",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "Slot",
    "Stage",
    "Step",
    "Timeline",
    "ZeroBubbleH1",
    "lower",
    "simulate",
    "split_sequential",
    "validate",
]
