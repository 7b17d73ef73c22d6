"""docs/ddp.md's PyTorch example as typed, under ``ferrodist run`` and under ``torchrun``.

    python bench/ddp/launchers.py [--rounds 3] [--json out.json]

The example (the block under "With a PyTorch model" in docs/ddp.md, read from the page)
runs unchanged on 2 ranks, ``--rounds`` times under each launcher, alternating. Its steps
are timed from outside: a ``sitecustomize`` module on the ranks' ``PYTHONPATH`` registers
torch's global optimizer step hook, and each rank writes the times between its successive
``opt.step()`` calls (a step: zero_grad, forward, backward with DDP's all_reduce, step).
A round's figure is the slower rank's median step; the table gives each launcher's median
over the rounds and the whole job's time. Both launchers start the ranks with the
environment as it is: what a user who types the commands gets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## With a PyTorch model"

SITECUSTOMIZE = """
import atexit, json, os, time

def _hook():
    import torch.optim.optimizer as optimizer

    stamps = []
    optimizer.register_optimizer_step_post_hook(lambda opt, args, kwargs: stamps.append(time.perf_counter()))
    out = os.path.join(os.environ["FERRODIST_BENCH_STEPS"], f"rank-{os.environ['RANK']}.json")
    atexit.register(lambda: open(out, "w").write(json.dumps([b - a for a, b in zip(stamps, stamps[1:])])))

if os.environ.get("FERRODIST_BENCH_STEPS") and "RANK" in os.environ:  # a rank, not a launcher
    try:
        _hook()
    except ImportError:
        pass
"""


def example() -> str:
    """The first ```python block after the heading, as the page types it."""
    page = (ROOT / "docs" / "ddp.md").read_text()
    rest = page[page.index(HEADING) :]
    found = re.search(r"```python\n(.*?)```", rest, re.S)
    if found is None:
        raise SystemExit(f"docs/ddp.md has no python block under {HEADING!r}")
    return found.group(1)


def launch(launcher: str, script: Path, hook: Path, steps: Path) -> float:
    """Run the example once; the job's seconds. Its ranks' step times are left in ``steps``."""
    env = dict(os.environ, FERRODIST_BENCH_STEPS=str(steps))
    env["PYTHONPATH"] = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])
    if launcher == "ferrodist run":
        command = [sys.executable, "-m", "ferrodist.launch", "run", "-n", "2", str(script)]
    else:
        torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
        command = [torchrun, "--nproc-per-node", "2", str(script)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=script.parent)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{launcher} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="jobs per launcher (default 3)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    launchers = ("ferrodist run", "torchrun")
    results: dict[str, dict[str, list[float]]] = {name: {"step": [], "job": []} for name in launchers}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        script = work / "train_torch.py"
        script.write_text(example())
        hook = work / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
        for round_ in range(args.rounds):
            for name in launchers if round_ % 2 == 0 else launchers[::-1]:
                steps = work / f"steps-{round_}-{name.split()[0]}"
                steps.mkdir()
                job = launch(name, script, hook, steps)
                ranks = [json.loads(p.read_text()) for p in sorted(steps.glob("rank-*.json"))]
                if len(ranks) != 2 or not all(ranks):
                    raise SystemExit(f"{name}: the ranks recorded no steps ({[len(r) for r in ranks]})")
                step = max(statistics.median(r) for r in ranks)
                results[name]["step"].append(step)
                results[name]["job"].append(job)
                print(f"  round {round_ + 1}, {name}: median step {step * 1e3:.1f} ms, job {job:.2f} s", flush=True)
    omp = os.environ.get("OMP_NUM_THREADS", "not set")
    print(f"\ndocs/ddp.md's PyTorch example, 2 ranks, OMP_NUM_THREADS {omp} in the caller's environment\n")
    print("| launcher | median step | job | step / torchrun's |\n|---|---|---|---|")
    reference = statistics.median(results["torchrun"]["step"])
    for name in launchers:
        step, job = statistics.median(results[name]["step"]), statistics.median(results[name]["job"])
        print(f"| `{name}` | {step * 1e3:.1f} ms | {job:.2f} s | {step / reference:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"omp_num_threads": omp, "results": results}, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
