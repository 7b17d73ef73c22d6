"""``run``: call a training function until it returns, recovering in place from lost ranks.

On a ferrodist failure inside ``train`` (a rank killed, crashed, or stopped past the
deadline: the group's collectives raise on every survivor), the survivors shrink the group
to the live ranks (``ProcessGroup.shrink``), every one of them takes the newest commit
(``State.sync``) and ``train`` is called again with the state. A rank the others left out
raises ``Excluded`` out of ``run``; so does any error that is not a failure of the group
(a bug in ``train``, an ``InvalidArgument`` too, is not retried).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ferrodist.collectives import is_replacement
from ferrodist.core import Excluded, FerrodistError, InvalidArgument

from ._state import Regrouped, State

T = TypeVar("T")

_log = logging.getLogger("ferrodist.elastic")


def run(
    train: Callable[[State], T],
    state: State,
    *,
    max_failures: int | None = None,
    timeout: float | None = None,
    window: float | None = None,
    on_recovery: Callable[[State, FerrodistError], None] | None = None,
) -> T:
    """``train(state)`` until it returns; after a failure of the group it trains on, shrink
    the group to the live ranks, bring every rank to the newest commit and call it again.

    Before the first call every rank commits (if it has not), and a replacement of a lost
    rank (see ``ferrodist run -n MIN:MAX``) gets the group's newest commit. ``train`` reads
    ``state.group`` (its rank and size change after a shrink or a join: shard the data by
    them), trains from ``state``'s values (the step), and calls ``state.commit()`` every few
    steps: the steps since the last commit are done again after a failure, and replacements
    waiting to join are taken in there (``train`` is then called again, on the larger group).

    Args:
        max_failures: recover from this many failures at most (default: as long as a
            majority of the group lives); the next is raised.
        timeout, window: the shrink's (see ``ProcessGroup.shrink``).
        on_recovery: called as ``on_recovery(state, error)`` after each recovery (the new
            group is ``state.group``), before ``train`` is called again.

    Raises:
        Excluded: the others went on without this rank; the process should exit.

    Example::

        state = State(model=net, optimizer=opt, step=0)

        def train(state):
            ddp = DDP(net, state.group)
            while state.step < 1000:
                ...one step on the shard of (state.step, state.group.rank, state.group.size)...
                state.step += 1
                if state.step % 10 == 0:
                    state.commit()

        run(train, state)
    """
    if max_failures is not None and max_failures < 0:
        raise InvalidArgument(f"run: max_failures must be 0 or more, not {max_failures!r}")
    if state.commits == 0 and not is_replacement():
        state.snapshot()
    state.sync()
    failures = 0
    while True:
        try:
            return train(state)
        except Regrouped as grown:
            _log.info("rank %d: %s", state.group.global_rank, grown)
            continue
        except (Excluded, InvalidArgument):
            raise  # left out, or a mistake that would happen again: not a failure to recover from
        except FerrodistError as exc:
            failures += 1
            if max_failures is not None and failures > max_failures:
                raise
            started = time.monotonic()
            lost = state.group
            state.group = lost.shrink(timeout=timeout, window=window)
            source = state.sync()
            left = [rank for rank in lost.ranks if rank not in state.group.ranks]
            _log.warning(
                "rank %d: %s: group %s shrank to ranks %s without %s in %.2f s; commit #%d from group rank %d",
                lost.global_rank,
                type(exc).__name__,
                lost.name,
                list(state.group.ranks),
                left,
                time.monotonic() - started,
                state.commits,
                source,
            )
            if on_recovery is not None:
                on_recovery(state, exc)
