"""What a job's collectives compile, for ``ferrodist warm`` and ``ferrodist doctor``, and
loading it into a process ahead of its groups (``preload``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferrodist.core import BackendUnavailable, CollectiveTimeout, DType, dtype
from ferrodist.core.kernels import MAX_FUSED_SOURCES, prepare, reduction_kernels
from ferrodist.transport import transport_kernels

__all__ = ["DEFAULT_DTYPES", "collective_kernels", "preload"]

#: What most jobs move: float32 and float64, the two 16-bit floats of mixed precision,
#: int64 (counts, indices) and bool (flags).
DEFAULT_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "bool")


def collective_kernels(dtypes: Sequence[DType], *, ranks: int = 4) -> list[tuple[Any, tuple[Any, ...]]]:
    """Every compiled kernel that collectives over ``dtypes`` run, in jobs of up to ``ranks``
    ranks per host: the transports' loops and the reductions of every op each dtype takes
    (as ``ferrodist.core.kernels.warm`` and ``cached`` take them; no duplicates).

    Example:
        >>> from ferrodist.core import float32
        >>> from ferrodist.core.kernels import cached
        >>> held, total = cached(collective_kernels([float32], ranks=2))  # what the cache holds
    """
    sources = tuple(range(1, max(2, min(ranks, MAX_FUSED_SOURCES)) + 1))
    return list(dict.fromkeys([*transport_kernels(dtypes), *reduction_kernels(dtypes, sources)]))


def preload(dtypes: Sequence[DType | str] = DEFAULT_DTYPES, *, ranks: int = 4, timeout: float = 300.0) -> int:
    """Load into this process the compiled kernels that collectives over ``dtypes`` run in
    jobs of up to ``ranks`` ranks per host (compiling what the disk cache lacks, as ``ferrodist
    warm`` does); returns how many. A process forked from this one afterwards starts its
    groups and makes its first calls without loading any: for harnesses that fork the ranks of
    each test from one parent (torch's ``MultiProcessTestCase``, a pytest fixture). A process
    started fresh loads what it uses by itself; this gains it nothing.

    Example::

        import ferrodist.collectives as dist
        dist.preload()                  # about a second from a warm cache
        for test in tests:              # each forks its ranks, which start groups at once
            run_forked(test)

    Raises:
        CollectiveTimeout: the kernels were not loaded (or compiled) within ``timeout``.
        BackendUnavailable: one of them did not compile.
    """
    items = collective_kernels([dtype(d) for d in dtypes], ranks=ranks)
    ticket = prepare(items, always=True)
    if not ticket.wait(timeout):
        if ticket.failed is not None:
            raise BackendUnavailable(f"preload: a kernel did not compile ({ticket.failed})")
        raise CollectiveTimeout(
            f"preload: {len(items)} kernels were still loading or compiling after {timeout:g} s; run `ferrodist "
            "warm` to fill the cache first, or raise the timeout"
        )
    return len(items)
