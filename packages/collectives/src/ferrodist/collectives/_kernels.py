"""What a job's collectives compile, for ``ferrodist warm`` and ``ferrodist doctor``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferrodist.core import DType
from ferrodist.core.kernels import MAX_FUSED_SOURCES, reduction_kernels
from ferrodist.transport import transport_kernels

__all__ = ["collective_kernels"]


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
