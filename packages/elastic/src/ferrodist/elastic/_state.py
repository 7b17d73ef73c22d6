"""``State``: what a training loop must have again after a failure, committed in memory.

A state holds objects with ``state_dict()`` / ``load_state_dict()`` (a ``ferrodist.nn`` or
PyTorch module, an optimizer of either) and plain values (the step, the epoch), each by the
name it was given. ``commit()`` copies them all into memory on this rank; ``restore()``
copies the last commit back, into the same objects (the same arrays: a DDP built over the
model still sees them), and clears their gradients. After a failure, ``sync()`` brings every rank of the (new) group to
the newest commit any of them holds: the lowest rank holding it sends it to the others.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ferrodist.collectives import (
    ProcessGroup,
    admit_replacements,
    all_gather_object,
    broadcast_object_list,
    default_group,
)
from ferrodist.core import InvalidArgument


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

    Example::

        state = State(model=net, optimizer=opt, step=0, epoch=0)
        state.step += 1          # a value
        state.commit()           # every few steps: an in-memory copy of all of it
        state.group.rank         # the group it trains on (a new one after a shrink)
    """

    def __init__(self, group: ProcessGroup | None = None, **entries: Any) -> None:
        if not entries:
            raise InvalidArgument("State: give it what to keep, e.g. State(model=net, optimizer=opt, step=0)")
        self._group = group if group is not None else default_group()
        self._objects = {name: obj for name, obj in entries.items() if _stateful(obj)}
        self._values = {name: value for name, value in entries.items() if name not in self._objects}
        self._commit: Commit | None = None
        self._commits = 0  # commits made on this rank (or received): the number of the last

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
        last commit is older, gets it whole), and every rank restores it. Returns the group
        rank that sent it."""
        group = self._group
        numbers: list[Any] = [None] * group.size
        all_gather_object(numbers, self._commits, group=group)
        newest = max(numbers)
        source = numbers.index(newest)
        if newest == 0:
            raise InvalidArgument(f"rank {group.global_rank}: State.sync: no rank of the group has committed yet")
        if any(number != newest for number in numbers):
            carried = [self._commit if group.rank == source else None]
            broadcast_object_list(carried, group=group, group_src=source)
            self._commit, self._commits = carried[0], newest
        self.restore()
        return source
