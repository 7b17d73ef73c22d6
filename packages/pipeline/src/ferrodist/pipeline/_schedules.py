"""The built-in schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble H1) and one written
by hand (``CustomSchedule``); what a schedule is, and its actions, is ``_actions``'s."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ferrodist.core import InvalidArgument

from ._actions import Action, Schedule, count
from ._check import runs

__all__ = ["CustomSchedule", "GPipe", "Interleaved1F1B", "OneFOneB", "ZeroBubbleH1"]


class GPipe(Schedule):
    """All forwards, then all fused backwards in micro-batch order (Huang et al., 2019).

    Bubble (p - 1) / (m + p - 1); every rank holds all m micro-batches' activations."""

    @functools.lru_cache(maxsize=64)  # noqa: B019 (schedules are immutable values)
    def _lists(self, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
        one = tuple(Action("F", i) for i in range(m)) + tuple(Action("BW", i) for i in range(m))
        return tuple(one for _ in range(p))


class OneFOneB(Schedule):
    """One forward, one backward (PipeDream-Flush / Megatron's 1F1B): rank r runs
    p - 1 - r warm-up forwards, then alternates F and BW, then drains the backwards.

    Same bubble as GPipe, (p - 1) / (m + p - 1), but rank r holds at most p - r micro-batches'
    activations at a time instead of m."""

    @functools.lru_cache(maxsize=64)  # noqa: B019
    def _lists(self, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
        lists = []
        for r in range(p):
            warmup = min(p - 1 - r, m)
            order = [Action("F", i) for i in range(warmup)]
            for i in range(m - warmup):
                order += [Action("F", warmup + i), Action("BW", i)]
            order += [Action("BW", i) for i in range(m - warmup, m)]
            lists.append(tuple(order))
        return tuple(lists)


class Interleaved1F1B(Schedule):
    """1F1B over ``virtual_stages`` model chunks per rank (Narayanan et al., 2021, Megatron-LM).

    Micro-batches go in groups of p: a group runs through chunk 0, then chunk 1, and so
    on, forwards in chunk order and backwards in reverse chunk order. Rank r warms up with
    2 (p - 1 - r) + (v - 1) p forwards (when p does not divide m, every rank's warm-up grows by
    the fewest forwards that make the order run, as ``validate`` checks). With equal costs and
    p dividing m, the bubble is (p - 1) / (v m + p - 1): v times smaller than 1F1B's, for v
    times as many messages."""

    def __init__(self, virtual_stages: int = 2) -> None:
        self.chunks = count("Interleaved1F1B: virtual_stages", virtual_stages)

    def __repr__(self) -> str:
        return f"Interleaved1F1B(virtual_stages={self.chunks})"

    @functools.lru_cache(maxsize=64)  # noqa: B019
    def _lists(self, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
        v = self.chunks
        forwards, backwards = [], []
        for start in range(0, m, p):
            group = range(start, min(start + p, m))
            forwards += [(i, c) for c in range(v) for i in group]
            backwards += [(i, c) for c in reversed(range(v)) for i in group]
        total = len(forwards)
        for extra in range(total + 1):
            lists = []
            for r in range(p):
                warmup = min(2 * (p - 1 - r) + (v - 1) * p + extra, total)
                order = [Action("F", i, c) for i, c in forwards[:warmup]]
                for k in range(total - warmup):
                    order += [Action("F", *forwards[warmup + k]), Action("BW", *backwards[k])]
                order += [Action("BW", *backwards[k]) for k in range(total - warmup, total)]
                lists.append(tuple(order))
            # Megatron's warm-up suffices when p divides m; a last, smaller group of
            # micro-batches can need more forwards first (all forwards first always runs).
            if m % p == 0 or runs(self, lists, p):
                return tuple(lists)
        raise AssertionError(f"{self!r}: no warm-up runs for p={p}, m={m}")


class ZeroBubbleH1(Schedule):
    """Zero-bubble ZB-H1 (Qi et al., 2023): backward split into B (input gradient, on the
    critical path) and W (weight gradient, deferred into what would be idle time).

    The order is what a unit-cost run gives when each rank, whenever it is free, runs the
    next B whose gradient has arrived, else the next F whose input has arrived, else the
    oldest deferred W. Two caps bound memory on rank r: at most p - r micro-batches between
    F and B (1F1B's bound), and at most 2p - 1 - r between F and W (the deferred W's fill the
    drain at the end of the step). With F = B = W the bubble is (p - 1) / (3 m + p - 1), a
    third of 1F1B's idle time, for up to 2p - 1 - r micro-batches held instead of p - r."""

    @functools.lru_cache(maxsize=64)  # noqa: B019
    def _lists(self, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
        done_f = [[-1] * m for _ in range(p)]  # end time of F(i) on stage s (-1: not yet)
        done_b = [[-1] * m for _ in range(p)]
        next_f, next_b = [0] * p, [0] * p
        deferred: list[list[int]] = [[] for _ in range(p)]  # B done, W not
        busy_until, orders = [0] * p, [[] for _ in range(p)]  # type: list[int], list[list[Action]]
        remaining, t = 3 * m * p, 0
        while remaining:
            if t > 6 * m * p + 2 * p:  # a unit-cost step takes about 3m + p units
                raise AssertionError(f"ZeroBubbleH1: the list scheduling stalled for p={p}, m={m}")
            for s in range(p):
                if busy_until[s] > t:
                    continue
                i, j = next_b[s], next_f[s]
                if i < j and 0 <= done_f[s][i] <= t and (s == p - 1 or 0 <= done_b[s + 1][i] <= t):
                    action, next_b[s], done_b[s][i] = Action("B", i), i + 1, t + 1
                    deferred[s].append(i)
                elif (
                    j < m
                    and j - i < p - s
                    and j - i + len(deferred[s]) < 2 * p - 1 - s
                    and (s == 0 or 0 <= done_f[s - 1][j] <= t)
                ):
                    action, next_f[s], done_f[s][j] = Action("F", j), j + 1, t + 1
                elif deferred[s]:
                    action = Action("W", deferred[s].pop(0))
                else:
                    continue
                orders[s].append(action)
                busy_until[s] = t + 1
                remaining -= 1
            t += 1
        return tuple(tuple(order) for order in orders)


class CustomSchedule(Schedule):
    """A schedule given as every rank's list (to check with ``validate`` before running).

    Args:
        lists: for each rank, its ordered actions (``Action`` or strings such as ``"F3"``,
            ``"BW0.1"``: kind, micro-batch, optional ``.chunk``).
        chunks: model chunks per rank (default: one more than the largest chunk named).
    """

    def __init__(self, lists: Sequence[Sequence[Action | str]], *, chunks: int | None = None) -> None:
        self._given = tuple(tuple(_parse(a) for a in actions) for actions in lists)
        if not self._given:
            raise InvalidArgument("CustomSchedule: lists must name at least one rank's actions")
        largest = max((a.chunk for actions in self._given for a in actions), default=0)
        self.chunks = count("CustomSchedule: chunks", chunks) if chunks is not None else largest + 1

    def __repr__(self) -> str:
        return f"CustomSchedule({[[str(a) for a in actions] for actions in self._given]}, chunks={self.chunks})"

    def _lists(self, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
        if p != len(self._given):
            raise InvalidArgument(f"CustomSchedule: it has lists for {len(self._given)} ranks, not {p}")
        return self._given


def _parse(action: Action | str) -> Action:
    if isinstance(action, Action):
        return action
    if not isinstance(action, str):
        raise InvalidArgument(f"CustomSchedule: an action must be an Action or a string like 'F3', not {action!r}")
    try:
        return Action.parse(action)
    except InvalidArgument as exc:
        raise InvalidArgument(f"CustomSchedule: {exc.message.removeprefix('Action.parse: ')}") from None
