"""Tracing a job: with ``FERRODIST_TRACE=DIR``, every rank writes what it did to
``DIR/rank-<global rank>.json`` as Chrome trace events (the "JSON array" form, one event a
line), which ``ferrodist trace DIR`` merges into one timeline for Perfetto or
chrome://tracing.

Each collective and point-to-point call is one complete event (``"ph": "X"``): its name is
the operation; it starts when the call's turn came (the calls issued before it on the
group had finished here) and ends when it returned; its ``args`` say the group, the call's
number, the bytes, the route, and how long it waited for its turn. DDP buckets and
pipeline actions are events too (``ferrodist.ddp``, ``ferrodist.pipeline``, through
:func:`span`). Each group, and each kind of event, is a track of the rank.

Off (the variable unset), nothing is opened, and a call pays one check of a ``None``.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

from ferrodist.core import InvalidArgument

__all__ = ["ENV", "Tracer", "close_all", "now", "sole_rank", "span", "tracer", "tracer_directory"]

#: The environment variable naming the directory the ranks write their traces to.
ENV = "FERRODIST_TRACE"

_lock = threading.Lock()
#: (directory, global rank) -> that rank's tracer (a simulated world has several ranks in
#: one process; a process keeps its tracers, and their files, until it exits).
_tracers: dict[tuple[str, int], Tracer] = {}


def now() -> int:
    """Nanoseconds on the clock the events use (the wall clock: ranks on one machine, or
    machines whose clocks are synchronised, line up)."""
    return time.time_ns()


class Tracer:
    """One rank's trace file: events appended a line at a time (flushed as they come, so a
    rank that dies leaves what it did)."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.path = directory / f"rank-{rank}.json"
        self._file: IO[str] | None = open(self.path, "w", buffering=1, encoding="utf-8")
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._write({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}, "[")
        self._write({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})

    def _write(self, event: dict[str, Any], lead: str = ",") -> None:
        file = self._file
        if file is not None:
            file.write(f"{lead}{json.dumps(event, separators=(',', ':'))}\n")

    def _track(self, name: str) -> int:
        tid = self._tracks.get(name)
        if tid is None:
            tid = self._tracks[name] = len(self._tracks) + 1
            self._write({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}})
            self._write(
                {"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid, "args": {"sort_index": tid}}
            )
        return tid

    def event(self, name: str, category: str, track: str, start: int, end: int, args: dict[str, Any]) -> None:
        """A complete event from ``start`` to ``end`` (ns from :func:`now`) on ``track``."""
        with self._lock:
            tid = self._track(track)
            self._write(
                {
                    "name": name,
                    "cat": category,
                    "ph": "X",
                    "ts": start / 1000,
                    "dur": max(end - start, 0) / 1000,
                    "pid": self.rank,
                    "tid": tid,
                    "args": args,
                }
            )

    def close(self) -> None:
        with self._lock:
            file, self._file = self._file, None
            if file is not None:
                file.write("]\n")
                file.close()


def tracer_directory() -> str | None:
    """The directory ``FERRODIST_TRACE`` names, or None (tracing is off)."""
    return os.environ.get(ENV) or None


def sole_rank() -> int | None:
    """The global rank traced in this process when there is one only (a real job), else None."""
    directory = tracer_directory()
    ranks = {rank for (where, rank) in list(_tracers) if where == directory}
    return ranks.pop() if len(ranks) == 1 else None


def tracer(rank: int) -> Tracer | None:
    """The tracer of global rank ``rank`` in this process, made on first use when
    ``FERRODIST_TRACE`` names a directory; None when tracing is off."""
    directory = tracer_directory()
    if directory is None:
        return None
    key = (directory, rank)
    found = _tracers.get(key)
    if found is not None:
        return found
    with _lock:
        found = _tracers.get(key)
        if found is None:
            try:
                found = _tracers[key] = Tracer(Path(directory), rank)
            except OSError as exc:
                raise InvalidArgument(
                    f"rank {rank}: {ENV}={directory!r}: cannot write the trace there ({exc}); "
                    "name a directory this process may create and write, or unset it"
                ) from None
            if len(_tracers) == 1:
                atexit.register(close_all)
    return found


def close_all() -> None:
    """End every trace file of this process (at exit; the files are complete before too)."""
    with _lock:
        tracers = list(_tracers.values())
        _tracers.clear()
    for found in tracers:
        found.close()


def span(rank: int, name: str, category: str, track: str, start: int, end: int | None = None, **args: Any) -> None:
    """Record an event of global rank ``rank`` from ``start`` to ``end`` (ns from
    :func:`now`; ``end`` defaults to now); nothing when tracing is off. For the packages
    built on the collectives (DDP's buckets, the pipeline's actions)."""
    found = tracer(rank)
    if found is not None:
        found.event(name, category, track, start, now() if end is None else end, args)
