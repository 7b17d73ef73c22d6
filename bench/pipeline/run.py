"""Pipeline step time of each schedule on 2 ranks, against the unsplit model in one process.

    python bench/pipeline/run.py [--ranks 2] [--backend shm]

Starts `ferrodist run -n RANKS bench/pipeline/step.py` (see there for the model) and prints
the median step of each schedule, its ratio to 1F1B and to one process running the unsplit
model on the whole batch (measured in the same run, after the pipelines), and the bubble
fraction `simulate` predicts with equal costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from ferrodist.pipeline import GPipe, Interleaved1F1B, OneFOneB, ZeroBubbleH1, simulate

STEP = Path(__file__).with_name("step.py")
SCHEDULES = {"GPipe": GPipe(), "1F1B": OneFOneB(), "Interleaved1F1B(2)": Interleaved1F1B(2), "ZB-H1": ZeroBubbleH1()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="shm")
    args = parser.parse_args()
    cmd = [sys.executable, "-m", "ferrodist.launch", "run", "-n", str(args.ranks), str(STEP), args.backend]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(done.stdout + done.stderr)
    line = next(line for line in done.stdout.splitlines() if '"schedules"' in line)
    result = json.loads(line[line.index("{") :])
    medians = {name: statistics.median(values) for name, values in result["schedules"].items()}
    unsplit = statistics.median(result["unsplit"])
    print(f"{args.ranks} ranks over {args.backend}; one process, unsplit: {unsplit * 1e3:.1f} ms per step")
    print("| schedule | step | vs 1F1B | vs one process | simulated bubble |\n|---|---|---|---|---|")
    for name, seconds in medians.items():
        bubble = simulate(SCHEDULES[name], args.ranks, 8).bubble_fraction
        print(
            f"| {name} | {seconds * 1e3:.1f} ms | {medians['1F1B'] / seconds:.2f}x | {unsplit / seconds:.2f}x | {bubble:.1%} |"
        )


if __name__ == "__main__":
    main()
