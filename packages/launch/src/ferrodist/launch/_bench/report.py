"""Tables, JSON and the busbw plot of a ``ferrodist bench`` run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ferrodist.launch._bench.sweep import FLOOR, busbw

__all__ = ["plot", "table", "write_json"]


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes} {unit}"
        nbytes //= 1024
    return f"{nbytes} TiB"


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def table(records: Sequence[dict[str, Any]], baseline: str | None = None) -> str:
    """Two Markdown tables per collective. Times: each library's time per size, the others'
    with their ratio to ``baseline``'s (above 1: the baseline is faster), and the memory
    floor's with ``baseline``'s time over it (1.0 would be memory speed) when it was
    measured. Bus bandwidth: GB/s per library. A column per library keeps rows narrow."""
    libraries = list(dict.fromkeys(r["library"] for r in records))
    candidates = [lib for lib in libraries if lib != FLOOR]
    baseline = baseline if baseline in candidates else (candidates[0] if candidates else None)
    out = []
    for op in dict.fromkeys(r["op"] for r in records):
        rows = [r for r in records if r["op"] == op]
        by = {(r["library"], r["bytes"]): r for r in rows}
        sizes = sorted({r["bytes"] for r in rows})
        out.append(f"### {op} ({rows[0]['ranks']} ranks, {rows[0]['dtype']}): time, and x {baseline}'s\n")
        out.append("| size | " + " | ".join(libraries) + " |")
        out.append("|" + "---|" * (len(libraries) + 1))
        for nbytes in sizes:
            base = by.get((baseline, nbytes)) if baseline else None
            cells = [_size(nbytes)]
            for lib in libraries:
                r = by.get((lib, nbytes))
                if r is None:
                    cells.append("-")
                elif lib == baseline or base is None:
                    cells.append(_time(r["seconds"]))
                elif lib == FLOOR:  # how far the baseline is from memory speed
                    cells.append(f"{_time(r['seconds'])} ({baseline} at {base['seconds'] / r['seconds']:.2f}x)")
                else:
                    cells.append(f"{_time(r['seconds'])} ({r['seconds'] / base['seconds']:.2f}x)")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out.append(f"busbw GB/s ({op}):\n")
        out.append("| size | " + " | ".join(candidates) + " |")
        out.append("|" + "---|" * (len(candidates) + 1))
        for nbytes in sizes:
            cells = [_size(nbytes)]
            for lib in candidates:
                r = by.get((lib, nbytes))
                cells.append(f"{busbw(op, nbytes, r['seconds'], r['ranks']):.2f}" if r else "-")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def write_json(path: str, records: Sequence[dict[str, Any]], extra: dict[str, Any]) -> None:
    enriched = [dict(r, busbw_gbps=busbw(r["op"], r["bytes"], r["seconds"], r["ranks"])) for r in records]
    with open(path, "w") as out:
        json.dump({**extra, "records": enriched}, out, indent=1)


def plot(path: str, records: Sequence[dict[str, Any]]) -> None:
    """busbw against size, one panel per collective, one line per library, both axes
    logarithmic (PNG). The memory floor has no busbw and is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in records))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        for lib in dict.fromkeys(r["library"] for r in records if r["library"] != FLOOR):
            rows = sorted((r for r in records if r["op"] == op and r["library"] == lib), key=lambda r: r["bytes"])
            if rows:
                ax.plot(
                    [r["bytes"] for r in rows],
                    [busbw(op, r["bytes"], r["seconds"], r["ranks"]) for r in rows],
                    marker="o",
                    label=lib,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("bytes")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
