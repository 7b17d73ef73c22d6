"""The DDP step benchmark: ferrodist's DDP against PyTorch's DDP over Gloo and against the
compute floor, same model and data, one table.

    python bench/ddp/run.py [--rounds 3] [--configs "ferrodist DDP, shm;ferrodist DDP, tcp"] [--batches small]
                            [--json out.json]

A 25.2 M-parameter MLP (torch, float32, one thread per rank), SGD with momentum. Two batch
sizes per rank: 8 (communication-bound: 100 MB of gradients per step against little
compute) and 256 (compute-bound). The floors: one rank alone without DDP, and two ranks
stepping at once without DDP (two independent processes: what two ranks cost the machine
before any communication, its memory bandwidth shared). Configurations run in rounds,
interleaved, so a busy moment of the machine hits all of them; each reports its median step
(after 12 warm-up steps, which cover DDP's overlap="auto" trials), and the table gives each
one's median over the rounds, its ratio
to PyTorch DDP over Gloo and its ratio to the one-rank floor, all measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

STEP = Path(__file__).with_name("ddp_step.py")

ONE_RANK = "floor: 1 rank, no DDP"
GLOO = "torch DDP, Gloo"
CONFIGS = [
    (ONE_RANK, "single", 1, {}),
    ("floor: 2 ranks at once, no DDP", "single", 2, {}),
    (GLOO, "torch-gloo", 2, {}),
    ("ferrodist DDP, shm", "ferrodist-shm", 2, {}),
    ("ferrodist DDP, shm, overlap on", "ferrodist-shm", 2, {"overlap": True}),
    ("ferrodist DDP, shm, overlap off", "ferrodist-shm", 2, {"overlap": False}),
    ("ferrodist DDP, shm, bf16 hook", "ferrodist-shm", 2, {"hook": "bf16"}),
    ("ferrodist DDP, shm, fp16 hook", "ferrodist-shm", 2, {"hook": "fp16"}),
    ("ferrodist DDP, tcp", "ferrodist-tcp", 2, {}),
    ("ferrodist DDP, tcp, bf16 hook", "ferrodist-tcp", 2, {"hook": "bf16"}),
]
BATCHES = {"small batch (8 per rank)": (8, 12), "large batch (256 per rank)": (256, 5)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(engine: str, ranks: int, batch: int, steps: int, options: dict) -> float:
    """The median step (seconds) of one configuration; ``single`` with ``ranks`` > 1 starts
    that many independent processes at once and returns the slowest one's."""
    args = [str(STEP), engine, str(batch), str(steps), json.dumps(options)]
    if engine == "single":
        commands = [[sys.executable, *args]] * ranks
    else:
        commands = [[sys.executable, "-m", "ferrodist.launch", "run", "-n", str(ranks), *args]]
    env = dict(os.environ, BENCH_TORCH_PORT=str(free_port()))
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in commands]
    medians = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"{engine} failed:\n{out}\n{err}")
        line = next(line for line in out.splitlines() if '"median"' in line)
        medians.append(float(json.loads(line[line.index("{") :])["median"]))
    return max(medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--configs",
        help="run only these configurations, by name, separated by ';' (the one-rank floor and Gloo always "
        "run: the ratios need them)",
    )
    parser.add_argument(
        "--batches", help="run only the batch sizes whose names start with one of these words (small, large)"
    )
    args = parser.parse_args()
    names = {n.strip() for n in (args.configs or "").split(";") if n.strip()}
    unknown = names - {c[0] for c in CONFIGS}
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; there are: {'; '.join(c[0] for c in CONFIGS)}")
    configs = [c for c in CONFIGS if not names or c[0] in (ONE_RANK, GLOO) or c[0] in names]
    kinds = [w.strip() for w in (args.batches or "").split(",") if w.strip()]
    batches = {b: v for b, v in BATCHES.items() if not kinds or any(b.startswith(k) for k in kinds)}
    results: dict[str, dict[str, list[float]]] = {b: {c[0]: [] for c in configs} for b in batches}
    for r in range(args.rounds):
        for batch_name, (batch, steps) in batches.items():
            for name, engine, ranks, options in configs:
                seconds = run(engine, ranks, batch, steps, dict(options))
                results[batch_name][name].append(seconds)
                print(
                    f"round {r + 1}: {batch_name}: {name}: {seconds * 1e3:.1f} ms per step", file=sys.stderr, flush=True
                )
    for batch_name, rows in results.items():
        gloo, alone = statistics.median(rows[GLOO]), statistics.median(rows[ONE_RANK])
        print(f"\n{batch_name}, median step over {args.rounds} rounds")
        print("| configuration | step | faster than torch DDP over Gloo | step / 1 rank without DDP |")
        print("|---|---|---|---|")
        for name, values in rows.items():
            m = statistics.median(values)
            print(f"| {name} | {m * 1e3:.1f} ms | {gloo / m:.2f}x | {m / alone:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
