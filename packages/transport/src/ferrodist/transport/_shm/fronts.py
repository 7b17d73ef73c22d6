"""The shared-memory collectives' compiled loops as ``ShmCollectives`` calls them: their
fronts, and the argument types it passes them (what ``ferrodist warm`` compiles)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ferrodist.core import DType, ReduceOp
from ferrodist.core.kernels import NotCompiled, background, plan, prepare

from . import loops

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "BROADCAST",
    "REDUCE_SCATTER",
    "ROUNDED",
    "SMALL",
    "SMALL_START",
    "pipeline_kernels",
    "small_first",
]

#: The compiled loops, called from Python only through their fronts: a call whose loop is not
#: compiled for its dtype yet raises ``NotCompiled`` before it starts, and its ``Twin`` in
#: ``ShmCollectives`` runs ``stepwise`` instead while the loop compiles in the background.
SMALL_START = background(loops.all_reduce_small_start)
SMALL = background(loops.all_reduce_small)
ALL_REDUCE = background(loops.all_reduce)
ROUNDED = background(loops.all_reduce_rounded)
BROADCAST = background(loops.broadcast)
ALL_GATHER = background(loops.all_gather)
REDUCE_SCATTER = background(loops.reduce_scatter)


def small_first(missing: NotCompiled) -> None:
    """What a miss of the one-slot all_reduce queues: its resumption first, then its start,
    so that a front that runs the start finds the resumption ready."""
    prepare([(SMALL, missing.types[:5]), (missing.front, missing.types)])


def pipeline_kernels(dtypes: Sequence[DType]) -> list[tuple[Any, tuple[Any, ...]]]:
    """The compiled loops that ``ShmCollectives`` runs for ``dtypes``, with the argument
    types it passes (``prepare``'s and ``warm``'s items): broadcast and all_gather move
    bytes (one loop for every dtype); all_reduce and reduce_scatter run per element type
    (the 16-bit floats as their bits, bool as bytes; reduce_scatter not for the 16-bit
    floats, which fold step by step; float32's loop through bfloat16 slots where both are
    listed)."""
    from numba import typeof, types

    data, words, state = typeof(np.zeros(1, np.uint8)), typeof(np.zeros(1, np.uint64)), typeof(loops.new_state())
    f, i = types.float64, types.int64
    items: list[tuple[Any, tuple[Any, ...]]] = [
        (BROADCAST, (data, data, words, state)),
        (ALL_GATHER, (data, data, data, words, state)),
    ]
    elements: dict[Any, bool] = {}
    for dt in dtypes:
        kind, view, _ = plan(dt, ReduceOp.SUM if ReduceOp.SUM in dt.ops else next(iter(dt.ops)))
        elements[typeof(np.zeros(1, view if view is not None else dt.numpy))] = not kind
    for x, pairwise in elements.items():
        items += [
            (SMALL, (x, data, words, state, f)),
            (SMALL_START, (x, data, words, state, f, i, i, i, i, i)),
            (ALL_REDUCE, (x, data, words, state, f)),
        ]
        if pairwise:
            items.append((REDUCE_SCATTER, (x, x, data, words, state, f)))
    if {"float32", "bfloat16"} <= {dt.name for dt in dtypes}:  # all_reduce(compress="bf16")
        items.append(
            (ROUNDED, (typeof(np.zeros(1, np.float32)), typeof(np.zeros(1, np.uint16)), data, words, state, f))
        )
    return items
