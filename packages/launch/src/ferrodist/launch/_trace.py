"""``ferrodist trace DIR``: merge the ranks' trace files (``FERRODIST_TRACE=DIR``) into one
timeline, and say which rank the others waited for.

Each rank wrote ``DIR/rank-<r>.json``: Chrome trace events, one a line, as a JSON array
(left open when the rank died). The merged file, ``DIR/trace.json``, is one trace with a
process per rank and a track per group (and per kind of DDP or pipeline event), for
https://ui.perfetto.dev or chrome://tracing; times start at 0.

A collective's event starts when its turn came on that rank, so across ranks the latest
start of one call (group and call number) is the rank the others were waiting for: the
summary lists the calls with the longest such waits and, per rank, how often it was last
and how long the others waited for it in all.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferrodist.core import BackendUnavailable, InvalidArgument

__all__ = ["Late", "Merged", "load_rank_file", "merge", "render_png", "summary"]

MERGED = "trace.json"


def load_rank_file(path: Path) -> list[dict[str, Any]]:
    """The events of one rank's file (complete or cut short by the rank's death)."""
    events = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        text = line.strip().lstrip("[,").rstrip("]").strip()
        if not text:
            continue
        try:
            events.append(json.loads(text))
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the last line of a rank that died while writing it
            raise InvalidArgument(f"ferrodist trace: {path}:{number} is not a trace event: {text[:80]!r}") from None
    return events


@dataclass(frozen=True)
class Late:
    """One call of a group, across ranks: who came last and how long the first waited."""

    group: str
    call: int
    operation: str
    last_rank: int
    waited_us: float
    ranks: int


@dataclass(frozen=True)
class Merged:
    """The merged trace and what was found in it."""

    path: Path
    ranks: list[int]
    events: int
    late: list[Late]


def _rank_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        raise InvalidArgument(
            f"ferrodist trace: no rank-*.json in {directory}; run the job with FERRODIST_TRACE={directory} "
            f"(or ferrodist run --trace {directory}) first"
        )
    return files


def _lateness(events: Iterable[dict[str, Any]]) -> list[Late]:
    calls: dict[tuple[str, int], dict[int, tuple[float, str]]] = defaultdict(dict)
    for event in events:
        if event.get("cat") != "collective" or event.get("ph") != "X":
            continue
        args = event.get("args", {})
        calls[(args.get("group", "?"), int(args.get("call", -1)))][int(event["pid"])] = (
            float(event["ts"]),
            str(event["name"]),
        )
    late = []
    for (group, call), starts in calls.items():
        if len(starts) < 2:
            continue
        last = max(starts, key=lambda r: starts[r][0])
        first = min(start for start, _ in starts.values())
        late.append(Late(group, call, starts[last][1], last, starts[last][0] - first, len(starts)))
    late.sort(key=lambda item: item.waited_us, reverse=True)
    return late


def merge(directory: str | Path, out: str | Path | None = None) -> Merged:
    """Merge ``directory``'s rank files into ``out`` (default ``directory/trace.json``)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InvalidArgument(f"ferrodist trace: {directory} is not a directory")
    everything: list[dict[str, Any]] = []
    ranks = []
    for path in _rank_files(directory):
        ranks.append(int(path.stem.split("-")[1]))
        everything.extend(load_rank_file(path))
    timed = [e["ts"] for e in everything if "ts" in e]
    origin = min(timed) if timed else 0.0
    for event in everything:
        if "ts" in event:
            event["ts"] = round(event["ts"] - origin, 3)
    target = Path(out) if out is not None else directory / MERGED
    target.write_text(json.dumps({"traceEvents": everything, "displayTimeUnit": "ms"}), encoding="utf-8")
    return Merged(target, ranks, sum(1 for e in everything if e.get("ph") == "X"), _lateness(everything))


def summary(merged: Merged, top: int = 10) -> str:
    """The merge in words: the file, the calls with the longest waits, and per rank."""
    lines = [
        f"ferrodist trace: {len(merged.ranks)} ranks, {merged.events} events -> {merged.path} "
        "(open it in https://ui.perfetto.dev or chrome://tracing)"
    ]
    if not merged.late:
        lines.append("no collective was traced on more than one rank")
        return "\n".join(lines)
    lines.append(f"the {min(top, len(merged.late))} calls where ranks waited longest for the last one to arrive:")
    lines.append("| group | call | operation | last rank | the first waited |")
    lines.append("|---|---|---|---|---|")
    for item in merged.late[:top]:
        lines.append(
            f"| {item.group} | #{item.call} | {item.operation} | {item.last_rank} | {item.waited_us / 1e3:.3f} ms |"
        )
    blame: dict[int, list[float]] = defaultdict(list)
    for item in merged.late:
        blame[item.last_rank].append(item.waited_us)
    lines.append("per rank: calls it was last to, and the time the first rank waited for it in all:")
    for rank in merged.ranks:
        waits = blame.get(rank, [])
        lines.append(f"  rank {rank}: last in {len(waits)} of {len(merged.late)} calls, {sum(waits) / 1e3:.3f} ms")
    return "\n".join(lines)


_COLOURS = {"collective": "#4c72b0", "p2p": "#55a868", "ddp": "#dd8452", "pipeline": "#8172b2"}


def render_png(merged: Merged, path: str | Path, *, tracks: Sequence[str] | None = None) -> None:
    """Draw the merged timeline (one row per rank and track, one bar per event, coloured
    by kind) into a PNG file (needs matplotlib: ``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailable("ferrodist trace --png needs matplotlib: pip install matplotlib") from None
    data = json.loads(Path(merged.path).read_text(encoding="utf-8"))["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in data if e.get("name") == "thread_name"}
    rows: list[tuple[int, int]] = sorted({(e["pid"], e["tid"]) for e in data if e.get("ph") == "X"})
    if tracks is not None:
        rows = [row for row in rows if names.get(row) in tracks]
    index = {row: k for k, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    for event in data:
        row = (event.get("pid"), event.get("tid"))
        if event.get("ph") != "X" or row not in index:
            continue
        ax.broken_barh(
            [(event["ts"] / 1e3, max(event["dur"] / 1e3, 1e-3))],
            (index[row] - 0.4, 0.8),
            facecolors=_COLOURS.get(event.get("cat", ""), "#999999"),
            edgecolor="white",
            linewidth=0.3,
        )
    ax.set_yticks(range(len(rows)), [f"rank {pid}: {names.get((pid, tid), tid)}" for pid, tid in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first event")
    kinds = sorted({e.get("cat", "") for e in data if e.get("ph") == "X"} & set(_COLOURS))
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=_COLOURS[k]) for k in kinds]
    ax.legend(handles, kinds, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(f"ferrodist trace: {len(merged.ranks)} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
