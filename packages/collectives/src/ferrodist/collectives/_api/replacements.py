"""Taking replacements of lost ranks into a running group (see ``_failures.replacements``)."""

from __future__ import annotations

from typing import Any

from ferrodist.collectives._api.default_group import resolve
from ferrodist.collectives._composed.objects import broadcast_object_list
from ferrodist.collectives._failures import replacements
from ferrodist.collectives._group import ProcessGroup
from ferrodist.collectives._timeouts import Timeout
from ferrodist.core import FerrodistError


def is_replacement() -> bool:
    """True in a process that ``ferrodist run -n MIN:MAX`` started in the place of a lost
    rank: its ``init_process_group`` joins the running job's group, at the group's next
    call to ``admit_replacements``, instead of starting a new job."""
    return replacements.is_replacement()


def admit_replacements(group: ProcessGroup | None = None, *, timeout: Timeout = None) -> ProcessGroup | None:
    """Take in the replacements of lost ranks that are waiting to join (a collective of
    ``group``, default the default group; ``ferrodist.elastic`` calls it at each commit):
    the group with them, over the same transport, or None when none waits (or the launcher
    keeps no join directory). The members agree on who joins first (group rank 0 looks, and
    tells the others), then each member connects to each replacement. When that fails (a
    replacement died), every member raises and the replacements are not tried again.

    Example (rank 2 of 3 was lost, and ``ferrodist run -n 2:3`` started another)::

        grown = admit_replacements(group)   # group ranks 0, 1 -> grown: ranks 0, 1, 2
    """
    g = resolve(group)
    place = replacements.directory()
    if place is None:
        return None
    found: list[Any] = [replacements.waiting(place, g.ranks) if g.rank == 0 else None]
    broadcast_object_list(g, found, 0, timeout=timeout)
    joiners: dict[int, str] = found[0]
    if not joiners:
        return None
    try:
        grown = g.grow(joiners, timeout=timeout)
    except FerrodistError:
        if g.rank == 0:  # a replacement that died, or never listened: do not try it again
            replacements.forget(place, sorted(joiners))
        raise
    if g.rank == 0:
        replacements.welcome(place, joiners, grown.ranks, grown.name)
    return grown
