"""Summarise a pytest-benchmark JSON file as a Markdown table: ferrodist against its reference.

Each benchmark group holds one ferrodist run and one reference run, told apart by
``extra_info["role"]`` (``"ferrodist"`` or ``"reference"``), which the suites in
``bench/`` record along with ``sources`` (k) and ``bytes_per_source``. For every group
this prints both medians, the ratio reference/ferrodist, and the memory bandwidth that
ferrodist's median implies for one fused pass: (k+1) buffers read or written.

Usage:
    python -m pytest bench --benchmark-only --benchmark-json=.benchmarks/kernels.json
    python tools/bench_ratios.py .benchmarks/kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load_groups(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """group -> role -> benchmark entry, for every benchmark that names its role."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        return {}
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for bench in data.get("benchmarks", []):
        role = bench.get("extra_info", {}).get("role")
        if bench.get("group") and role in ("ferrodist", "reference"):
            groups.setdefault(bench["group"], {})[role] = bench
    return groups


def ratio_text(ratio: float) -> str:
    if ratio >= 1.0:
        return f"{ratio:.2f}x faster"
    return f"{ratio:.2f}x ({1 / ratio:.2f}x slower)"


def table(groups: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "| group | ferrodist median (ms) | reference median (ms) | reference/ferrodist | ferrodist bandwidth (GB/s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in sorted(groups):
        runs = groups[name]
        ours, ref = runs.get("ferrodist"), runs.get("reference")
        if ours is None or ref is None:
            missing = "ferrodist" if ours is None else "reference"
            lines.append(f"| {name} | - | - | no {missing} run | - |")
            continue
        ours_s, ref_s = ours["stats"]["median"], ref["stats"]["median"]
        info = ours["extra_info"]
        moved = (info["sources"] + 1) * info["bytes_per_source"]
        lines.append(
            f"| {name} | {ours_s * 1e3:.1f} | {ref_s * 1e3:.1f} | {ratio_text(ref_s / ours_s)} "
            f"| {moved / ours_s / 1e9:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_file", type=Path, help="file written by pytest --benchmark-json=PATH")
    args = parser.parse_args(argv)
    path: Path = args.json_file
    if not path.is_file():
        print(f"bench_ratios: {path} does not exist; run pytest bench --benchmark-json={path} first", file=sys.stderr)
        return 1
    try:
        groups = load_groups(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        print(f"bench_ratios: {path} is not a pytest-benchmark JSON file ({exc})", file=sys.stderr)
        return 1
    if not groups:
        print(
            f"bench_ratios: {path} has no benchmark groups with extra_info['role']; "
            "was it written by the suites in bench/ with --benchmark-only?",
            file=sys.stderr,
        )
        return 1
    print("\n".join(table(groups)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
