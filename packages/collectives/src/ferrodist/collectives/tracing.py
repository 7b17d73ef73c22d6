"""Adding to a job's trace (public): with ``FERRODIST_TRACE=DIR`` set, :func:`span` records
an event on a rank's timeline beside its collectives, for packages and programs built on
``ferrodist.collectives`` (DDP's buckets and the pipeline's actions use it). With the
variable unset it records nothing. ``ferrodist trace DIR`` merges the ranks' files.

Example::

    from ferrodist.collectives import default_group, tracing

    start = tracing.now()
    loss = train_step()
    tracing.span(default_group(), "train_step", "user", "steps", start, step=i)
"""

from __future__ import annotations

from typing import Any

from . import _trace
from ._group import ProcessGroup
from ._trace import ENV, close_all, now

__all__ = ["ENV", "close_all", "enabled", "now", "span"]


def enabled() -> bool:
    """True when ``FERRODIST_TRACE`` names a directory (worth measuring what to record)."""
    return _trace.tracer_directory() is not None


def span(where: Any, name: str, category: str, track: str, start: int, end: int | None = None, **args: Any) -> None:
    """Record ``name`` from ``start`` to ``end`` (nanoseconds from :func:`now`; ``end``
    defaults to now) on ``track`` of a rank's timeline, with ``args`` shown beside it.

    ``where`` says whose timeline: a ``ProcessGroup`` (this process's rank in it), a global
    rank (an ``int``), or another group object (the one rank traced in this process, if
    there is exactly one). Nothing happens when tracing is off.
    """
    if _trace.tracer_directory() is None:
        return
    if isinstance(where, ProcessGroup):
        rank: int | None = where.global_rank
    elif isinstance(where, int) and not isinstance(where, bool):
        rank = where
    else:
        rank = _trace.sole_rank()
    if rank is not None:
        _trace.span(rank, name, category, track, start, end, **args)
