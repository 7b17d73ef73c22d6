"""``State``: what a training loop must have again after a failure, committed in memory.

A state holds objects with ``state_dict()`` / ``load_state_dict()`` (a ``ferrodist.nn`` or
PyTorch module, an optimizer of either) and plain values (the step, the epoch), each by the
name it was given. ``commit()`` copies them all into memory on this rank; ``restore()``
copies the last commit back, into the same objects (the same arrays: a DDP built over the
model still sees them), and clears their gradients. After a failure, ``sync()`` brings every
rank of the (new) group to the newest commit any of them holds: the lowest rank holding it
sends it to the others.

Where ranks hold different states (the stages of a pipeline), ``role`` says which hold the
same (a function of the global rank, e.g. the stage): ``sync`` then brings each rank to the
newest commit of its role, from the lowest rank of that role holding it. A rank whose role
no complete pipeline uses after a failure keeps its place with ``stand_by()`` at each
commit point, without committing, until replacements make its pipeline whole again. With
``backup=True`` each commit is also kept by the next rank of the group, so that a role
whose every holder is lost (a pipeline's stage without replicas) comes back from that copy.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ferrodist.collectives import (
    ProcessGroup,
    admit_replacements,
    all_gather_object,
    broadcast_object_list,
    default_group,
    recv_object_list,
    send_object_list,
)
from ferrodist.core import InvalidArgument

_LOOK = 0.1  # seconds between a stand-by's looks for replacements (``stand_by(wait=)``)


class Regrouped(Exception):
    """Raised by ``State.commit`` after replacements of lost ranks joined: the state now
    trains on a larger group (``state.group``), every rank holding the commit just made;
    ``ferrodist.elastic.run`` catches it and calls the training function again."""


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@dataclass(frozen=True)
class Commit:
    """One commit: its number (1, 2, ... on every rank alike), the objects' state dicts and
    the values, all copies."""

    number: int
    objects: dict[str, Any]
    values: dict[str, Any]


class State:
    """The model, the optimizer and your own values of an elastic training loop (see
    ``ferrodist.elastic.run``): objects with ``state_dict``/``load_state_dict`` are saved
    through those, anything else is a value, read and set as an attribute.

    ``role``: for ranks that do not all hold the same state, which do (see the module's
    docstring): ``role(global_rank)`` is the same value on the ranks that hold the same
    state, e.g. ``lambda rank: rank % 2`` for the stage of a pipeline of two stages
    replicated across pipelines. ``backup``: at each commit, also send it to the next rank
    of the group (group rank + 1, the last to the first), which keeps it beside its own: a
    role whose every holder is lost comes back from there (twice the memory, and the
    commit's bytes sent once per commit).

    Example::

        state = State(model=net, optimizer=opt, step=0, epoch=0)
        state.step += 1          # a value
        state.commit()           # every few steps: an in-memory copy of all of it
        state.group.rank         # the group it trains on (a new one after a shrink)
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        *,
        role: Callable[[int], Hashable] | None = None,
        backup: bool = False,
        **entries: Any,
    ) -> None:
        if not entries:
            raise InvalidArgument("State: give it what to keep, e.g. State(model=net, optimizer=opt, step=0)")
        if role is not None and not callable(role):
            raise InvalidArgument(f"State: role must be a function of the global rank (rank -> key), not {role!r}")
        self._role = role
        self._group = group if group is not None else default_group()
        self._objects = {name: obj for name, obj in entries.items() if _stateful(obj)}
        self._values = {name: value for name, value in entries.items() if name not in self._objects}
        self._commit: Commit | None = None
        self._commits = 0  # commits made on this rank (or received): the number of the last
        self._backup = bool(backup)
        self._kept: tuple[Any, Commit] | None = None  # (role, commit) of the previous rank, with backup

    # -- what the loop sees --------------------------------------------------------------------
    @property
    def group(self) -> ProcessGroup:
        """The group to train on: the one given, or the last shrink's."""
        return self._group

    @group.setter
    def group(self, group: ProcessGroup) -> None:
        self._group = group

    @property
    def commits(self) -> int:
        """The number of the last commit this rank holds (0: none yet)."""
        return self._commits

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._values:
            return self._values[name]
        if name in self._objects:
            return self._objects[name]
        raise AttributeError(f"State has no entry {name!r} (it has {sorted([*self._objects, *self._values])})")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name == "group":
            object.__setattr__(self, name, value)
        elif name in self._objects:
            raise InvalidArgument(
                f"State: {name} is an object whose state is kept ({type(self._objects[name]).__name__}); change it "
                "in place (load_state_dict) instead of replacing it"
            )
        else:
            self._values[name] = value

    def __repr__(self) -> str:
        return f"<State {sorted(self._objects)} values={self._values} commit #{self._commits} on {self._group.name}>"

    # -- commit, restore, sync -----------------------------------------------------------------
    def commit(self) -> None:
        """Copy every object's state and every value into memory on this rank (replacing the
        last commit); then take in the replacements of lost ranks that wait to join (under
        ``ferrodist run -n MIN:MAX``), which get the commit from a peer, and raise
        ``Regrouped`` if any did. Every rank of the group commits at the same steps."""
        self.snapshot()
        if self._backup:
            self._pass_on()
        self.stand_by()

    def _pass_on(self) -> None:
        """Send this commit to the next rank of the group and keep the previous rank's (the
        ranks of even group rank send first, so that the ring of messages cannot wait on itself)."""
        group = self._group
        if group.size < 2:
            return
        mine, got = [self._role_of(group.global_rank), self._commit], [None, None]
        after, before = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        if group.rank % 2 == 0:
            send_object_list(mine, group=group, group_dst=after)
            recv_object_list(got, group=group, group_src=before)
        else:
            recv_object_list(got, group=group, group_src=before)
            send_object_list(mine, group=group, group_dst=after)
        self._kept = (got[0], got[1])  # type: ignore[assignment]

    def _role_of(self, rank: int) -> Any:
        return None if self._role is None else self._role(rank)

    def stand_by(self, wait: float = 0.0) -> None:
        """A commit point without the commit: take in the replacements waiting to join, as
        ``commit`` does (and raise ``Regrouped`` if any did), for a rank that keeps its place
        but does not train (a stage of a pipeline that lost another stage: see ``role``); it
        gets its role's newest commit when they join.

        ``wait``: where no rank of the group trains (every one stands by: a pipeline without
        replicas that lost a stage), look again every 0.1 s for up to ``wait`` seconds (the
        same number of looks on every rank, each a collective) and return only if none
        came. Where others train, leave it 0: they call ``commit`` once per commit point."""
        looks = max(1, math.ceil(wait / _LOOK))  # one look without a wait
        for look in range(looks):
            if look:
                time.sleep(_LOOK)
            grown = admit_replacements(self._group)
            if grown is not None:
                self._group = grown
                self.sync()
                raise Regrouped(f"ranks {list(grown.ranks)} train on from commit #{self._commits}")

    def snapshot(self) -> None:
        """``commit`` on this rank alone: the copy, without looking for replacements."""
        self._commits += 1
        objects = {name: copy.deepcopy(obj.state_dict()) for name, obj in self._objects.items()}
        self._commit = Commit(self._commits, objects, copy.deepcopy(self._values))

    def restore(self) -> None:
        """Put the last commit back: into the same objects (in place) and values. Gradients
        are not part of a commit: those of an object with ``zero_grad()`` (a module, an
        optimizer) are cleared, so the step that failed leaves none behind."""
        saved = self._commit
        if saved is None:
            raise InvalidArgument("State.restore: nothing was committed yet; call commit() first")
        for name, obj in self._objects.items():
            obj.load_state_dict(copy.deepcopy(saved.objects[name]))
            if callable(getattr(obj, "zero_grad", None)):
                obj.zero_grad()
        self._values.clear()
        self._values.update(copy.deepcopy(saved.values))

    def sync(self) -> int:
        """Bring every rank of the group to the newest commit any of them holds (a collective):
        the lowest rank holding it sends it to the others (a rank that joined, or one whose
        last commit is older, gets it whole), and every rank restores it; with a ``role``,
        each rank to the newest commit of its role. Returns the group rank that sent this
        rank's.

        Raises:
            InvalidArgument: on every rank, when no rank of the group (of some role) holds a
                commit: the state of a role whose every holder was lost is gone from memory.
        """
        group = self._group
        found: list[Any] = [None] * group.size
        kept = (None, 0) if self._kept is None else (self._kept[0], self._kept[1].number)
        all_gather_object(found, (self._commits, self._role_of(group.global_rank), *kept), group=group)
        roles: dict[Any, list[int]] = {}
        for rank, (_, role, _, _) in enumerate(found):
            roles.setdefault(role, []).append(rank)
        source = -1
        for role, holders in roles.items():  # the same order on every rank: by their lowest rank
            numbers = [found[rank][0] for rank in holders]
            copies = [rank for rank, entry in enumerate(found) if entry[2] == role and entry[3] > max(numbers)]
            if copies:  # a backup newer than any holder's commit (its holders were lost)
                first = max(copies, key=lambda rank: (found[rank][3], -rank))
                newest, carried = found[first][3], [self._kept[1] if group.rank == first else None]  # type: ignore[index]
            else:
                newest, first = max(numbers), holders[numbers.index(max(numbers))]
                carried = [self._commit if group.rank == first else None]
            if newest == 0:
                whose = "" if self._role is None else f" of role {role!r} (ranks {[group.ranks[r] for r in holders]})"
                raise InvalidArgument(
                    f"rank {group.global_rank}: State.sync: no rank of group {group.name}{whose} holds a commit: "
                    "call commit() before the first failure; a state every holder of which was lost is gone from "
                    "memory (State(backup=True) keeps a copy on another rank; or start again from a checkpoint)"
                )
            if copies or any(number != newest for number in numbers):
                broadcast_object_list(carried, group=group, group_src=first)
                if group.rank in holders:
                    self._commit, self._commits = carried[0], newest
            if group.rank in holders:
                source = first
        self.restore()
        return source
