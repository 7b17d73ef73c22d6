"""torch's own distributed suite, timed on Gloo and on "ferrodist" over each transport, in one run.

    python bench/torch/suite.py [--ranks 4] [--transports shm,tcp] [--json out.json]

Runs the whole of torch 2.13's ``DistributedTest._DistTestBase`` (what
tests/torch/scripts/torch_suite.py runs: each test forks ``--ranks`` processes from one
parent, which starts a default group, runs the test and destroys its groups; the tests
that do not apply skip inside the forked ranks, after their group has started) once on
Gloo, then once on ferrodist over each transport. Prints each run's wall time, its ratio
to Gloo's, and what passed; ``--json`` writes the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "torch" / "scripts" / "torch_suite.py"
#: Variables of an enclosing job that must not reach the suite's ranks.
PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FERRODIST_TOKEN")


def run(backend: str, transport: str | None, ranks: int) -> dict[str, Any]:
    """One run of the whole class; its wall time and outcomes."""
    env = {k: v for k, v in os.environ.items() if k not in PLACE and not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    env.update(WORLD_SIZE=str(ranks), PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    if transport is not None:
        env["FERRODIST_TORCH_TRANSPORT"] = transport
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out.json"
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(SCRIPT), backend, str(out)], env=env, cwd=scratch, capture_output=True, text=True
        )
        wall = time.perf_counter() - started
        if not out.exists():
            raise SystemExit(
                f"torch's suite on {backend} did not finish (exit {done.returncode}):\n{done.stderr[-4000:]}"
            )
        tests = json.loads(out.read_text())["tests"]
    outcomes = {name: row[0] for name, row in tests.items()}
    return {
        "backend": backend,
        "transport": transport,
        "seconds": round(wall, 2),
        "tests": len(outcomes),
        "passed": sorted(name for name, outcome in outcomes.items() if outcome == "pass"),
        "not_passed": sorted(name for name, outcome in outcomes.items() if outcome in ("fail", "error")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args()
    runs = [run("gloo", None, args.ranks)]
    runs += [run("ferrodist", transport, args.ranks) for transport in args.transports.split(",")]
    gloo = runs[0]
    print(f"torch's suite ({gloo['tests']} tests) at {args.ranks} ranks, each forked from one parent")
    print(f"{'backend':<16} {'seconds':>8} {'/ Gloo':>7} {'passed':>7}  not passed")
    for result in runs:
        name = result["backend"] + (f" {result['transport']}" if result["transport"] else "")
        print(
            f"{name:<16} {result['seconds']:>8.1f} {result['seconds'] / gloo['seconds']:>6.2f}x "
            f"{len(result['passed']):>7}  {', '.join(result['not_passed']) or '-'}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
