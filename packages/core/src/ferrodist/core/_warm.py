"""Filling the kernel cache before a job runs (``ferrodist warm``), and saying how full it is.

A job on an empty cache runs its interpreted paths while the kernels compile beside it.
:func:`warm` compiles a list of kernels (a front and its argument types, as
:func:`prepare` takes them) into Numba's disk cache ahead of time, in several compile
helpers at once, so that every process started afterwards loads them in milliseconds.
What each package needs is declared by that package (:func:`reduction_kernels` here; the
transport declares its loops). :func:`cached` tells how many of a list are in the cache
(read from the cache's indexes: nothing is loaded or compiled).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._compile.background import Front, background
from ._compile.helper import Helper, HelperGone, compile_here, in_cache
from ._dtypes import DType
from ._ops import ReduceOp

__all__ = ["Warmed", "cached", "reduction_kernels", "warm"]

Item = tuple[Front, tuple[Any, ...]]

#: The source counts a job's reductions use: 1 (a group of one), 2 (ring and tree steps,
#: in place or not), and one per rank where every rank's block is folded at once.
SOURCES = (1, 2, 3, 4)


def reduction_kernels(dtypes: Iterable[DType], sources: Sequence[int] = SOURCES) -> list[Item]:
    """The compiled reductions that collectives over ``dtypes`` call (every op each dtype
    takes), with the argument types ``reducer`` passes: ``dst`` apart from the sources for
    every count in ``sources``, and ``dst`` as the first or second source for two."""
    from numba import typeof, types

    from ._kernels import fold_kernel
    from ._reduce import plan

    items: list[Item] = []
    dtypes = list(dtypes)
    for dt in dtypes:
        for op in sorted(dt.ops, key=lambda o: o.value):
            if op is ReduceOp.AVG and not dt.is_floating:
                continue  # an integer AVG folds as SUM, with SUM's kernel
            kind, view, opcode = plan(dt, op)
            array = typeof(np.zeros(1, view if view is not None else dt.numpy))
            for k in sources:
                for place in (0,) if k == 1 else (-1, 0, 1) if k == 2 else (-1,):
                    front = background(fold_kernel(kind, opcode, op is ReduceOp.AVG, place))
                    items.append((front, (array, types.UniTuple(array, k), types.float64)))
    if {"float32", "bfloat16"} <= {dt.name for dt in dtypes}:
        from ._casts import cast_twins  # compress="bf16" on the host, around a call

        narrow, widen = cast_twins()
        assert narrow.front is not None and widen.front is not None  # twins of jit functions
        bits, values = typeof(np.zeros(1, np.uint16)), typeof(np.zeros(1, np.float32))
        items += [(narrow.front, (bits, values)), (widen.front, (values, bits))]
    return items


def cached(items: Iterable[Item]) -> tuple[int, int]:
    """``(in the cache, of)``: how many of ``items`` Numba's disk cache holds now."""
    listed = list(items)
    return sum(in_cache(front.source, types) for front, types in listed), len(listed)


@dataclass
class Warmed:
    """What :func:`warm` did."""

    total: int = 0  # kernels asked for
    cached: int = 0  # in the cache already
    compiled: int = 0  # compiled now
    failed: list[str] = field(default_factory=list)  # "function(types): reason"
    seconds: float = 0.0


def warm(
    items: Iterable[Item], *, processes: int | None = None, progress: Callable[[int, int], None] | None = None
) -> Warmed:
    """Compile into the disk cache each of ``items`` that it lacks, ``processes`` compile
    helpers at a time (default: one per core), each at a low CPU priority, and wait for all.
    ``progress(done, to_do)`` is called after each. The processes of this host that compile
    the same function meanwhile (ranks, another ``warm``) wait for each other: each kernel is
    compiled once.

    Example:
        >>> from ferrodist.core import float32
        >>> done = warm(reduction_kernels([float32]))
        >>> done.cached + done.compiled == done.total
        True
    """
    started = time.perf_counter()
    unique = list(dict.fromkeys(items))
    todo = collections.deque(item for item in unique if not in_cache(item[0].source, item[1]))
    result = Warmed(total=len(unique), cached=len(unique) - len(todo))
    count, lock = len(todo), threading.Lock()

    def work() -> None:
        helper = Helper()
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    front, types = todo.popleft()
                failed = None
                try:
                    if front.recipe is None:
                        raise HelperGone("no recipe: compiled here")
                    failed = helper.compile(front.recipe, types)
                except HelperGone:
                    try:
                        compile_here(front.source, types)
                    except Exception as exc:
                        failed = f"{type(exc).__name__}: {exc}"
                with lock:
                    if failed is None:
                        result.compiled += 1
                    else:
                        result.failed.append(f"{front.py_func.__qualname__}{types}: {failed}")
                    done = result.compiled + len(result.failed)
                if progress is not None:
                    progress(done, count)
        finally:
            helper.close(wait=True)

    workers = [
        threading.Thread(target=work, name=f"ferrodist-warm-{i}", daemon=True)
        for i in range(max(1, min(processes or os.cpu_count() or 1, len(todo))))
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    result.seconds = time.perf_counter() - started
    return result
