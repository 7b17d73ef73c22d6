"""ferrodist.elastic: training that survives lost ranks without a restart.

A ``State`` holds the model, the optimizer and your own values and is committed in memory
every few steps; ``run(train, state)`` calls ``train(state)`` and, when a rank is lost,
shrinks the group to the live ranks, brings them all to the newest commit (from a peer,
not a file) and calls ``train`` again::

    from ferrodist.elastic import State, run

    state = State(model=net, optimizer=opt, step=0)

    def train(state):
        ddp = DDP(net, state.group)         # the group shrinks: read it on every call
        while state.step < 1000:
            ...                             # shard the data by state.group.rank and .size
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    run(train, state)

A rank the others left out raises ``Excluded``. See docs/elastic.md.
"""

from __future__ import annotations

from ferrodist.core import Excluded

from ._run import run
from ._state import Commit, Regrouped, State

__all__ = ["Commit", "Excluded", "Regrouped", "State", "run"]
