"""A new user's first torch jobs: DDP of a small MLP over "ferrodist" against the same over
"gloo", job after job, the first one included.

    python bench/torch/first_job.py [--steps 200] [--jobs 2] [--cold] [--json out.json]

Each job is ``ferrodist run -n 2`` of this file as a rank (one process per rank, a job of
its own per backend, as a user runs them): torch's ``DistributedDataParallel`` of a
3-layer MLP (32 -> 256 -> 256 -> 10, 76 k parameters: 305 KB of gradients per step), batch
64 per rank, SGD with momentum, ``--steps`` steps, every step timed. A job's figure is the
slowest rank's median step; the table also shows the median of each tenth of the job, so
that a slow start shows. Jobs alternate, ferrodist first: ferrodist, gloo, ferrodist, gloo...

The kernel cache is the one this install uses (after ``make demo``, ``make test`` or
``ferrodist warm``: warm). ``--cold`` first runs the same jobs on an empty cache of their own
(``NUMBA_CACHE_DIR`` in a scratch directory, nothing warmed): what a user who never ran
``ferrodist warm`` gets. Every ferrodist job ends with parameters equal to Gloo's job
(same seeds): the script says so, or fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WIDTHS = (32, 256, 256, 10)
BATCH = 64
TENTHS = 10


# -- a rank ------------------------------------------------------------------------------------
def rank_main(backend: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "ferrodist":
        import ferrodist.torch  # noqa: F401  (registers "ferrodist")

    started = time.perf_counter()
    dist.init_process_group(backend)
    init = time.perf_counter() - started
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTHS[0], generator=gen)
        y = torch.randint(0, WIDTHS[-1], (BATCH,), generator=gen)
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"times": times, "init": init, "digest": digest})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()
    # Leave without the interpreter's finalization: there torch 2.13's Gloo sometimes aborts
    # (std::terminate from its worker threads; 1 job in 6 here), after the figures are in.
    sys.stdout.flush()
    os._exit(0)


# -- the driver --------------------------------------------------------------------------------
def job(backend: str, steps: int, env: dict[str, str]) -> dict[str, Any]:
    """One job of 2 ranks; its slowest rank's median step, the median of each tenth (slowest
    rank), init's time and the parameters' digest."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "ranks.json")
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "ferrodist.launch", "run", "-n", "2", __file__, "--rank", backend, str(steps), out],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"the {backend} job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        ranks = json.loads(Path(out).read_text())
    per_tenth = max(1, steps // TENTHS)
    tenths = [max(statistics.median(r["times"][i : i + per_tenth]) for r in ranks) for i in range(0, steps, per_tenth)][
        :TENTHS
    ]
    return {
        "backend": backend,
        "median_ms": max(statistics.median(r["times"]) for r in ranks) * 1e3,
        "tenths_ms": [t * 1e3 for t in tenths],
        "init_s": max(r["init"] for r in ranks),
        "wall_s": wall,
        "digest": ranks[0]["digest"],
    }


def series(label: str, jobs: int, steps: int, env: dict[str, str]) -> list[dict[str, Any]]:
    results = []
    for number in range(1, jobs + 1):
        for backend in ("ferrodist", "gloo"):
            result = job(backend, steps, env)
            result.update(cache=label, job=number)
            results.append(result)
            print(
                f"  {label} cache, job {number}, {backend:9s}: median step {result['median_ms']:.2f} ms "
                f"(tenths: {' '.join(f'{t:.1f}' for t in result['tenths_ms'])}), init {result['init_s']:.2f} s, "
                f"job {result['wall_s']:.1f} s",
                flush=True,
            )
    return results


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| cache | job | ferrodist median step | Gloo median step | Gloo / ferrodist | ferrodist's slowest tenth |",
        "|---|---|---|---|---|---|",
    ]
    for cache in dict.fromkeys(r["cache"] for r in results):
        rows = [r for r in results if r["cache"] == cache]
        for number in sorted({r["job"] for r in rows}):
            ours = next(r for r in rows if r["job"] == number and r["backend"] == "ferrodist")
            gloo = next(r for r in rows if r["job"] == number and r["backend"] == "gloo")
            lines.append(
                f"| {cache} | {number} | {ours['median_ms']:.2f} ms | {gloo['median_ms']:.2f} ms | "
                f"{gloo['median_ms'] / ours['median_ms']:.2f}x | {max(ours['tenths_ms']):.2f} ms |"
            )
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per job (default 200)")
    parser.add_argument("--jobs", type=int, default=2, help="jobs per backend (default 2)")
    parser.add_argument("--cold", action="store_true", help="first run the jobs on an empty kernel cache")
    parser.add_argument("--json", default=None, help="also write every job's figures to this file")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("FERRODIST_KERNELS", "NUMBA_CACHE_DIR")}
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    results: list[dict[str, Any]] = []
    print(f"DDP of a {'-'.join(map(str, WIDTHS))} MLP, batch {BATCH} per rank, 2 ranks, {args.steps} steps per job")
    if args.cold:
        with tempfile.TemporaryDirectory(prefix="ferrodist-cold-cache-") as cache:
            results += series("empty", args.jobs, args.steps, {**env, "NUMBA_CACHE_DIR": cache})
    results += series("this install's", args.jobs, args.steps, env)
    digests = {r["digest"] for r in results}
    if len(digests) != 1:
        raise SystemExit(f"the jobs ended with different parameters: {sorted(digests)}")
    print()
    print(table(results))
    print("\nevery job ended with the same parameters (ferrodist and Gloo)")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "jobs": results}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
