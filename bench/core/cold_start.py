"""A fresh install's first jobs, on an empty Numba cache, against the same jobs warm.

Two measurements, each in one run of this script:

- **first job**: ``ferrodist run -n 2`` of a job that inits the shm world and runs a
  float32 and a bfloat16 all_reduce (one small, one over several chunks) and a
  broadcast, every result checked on every rank. Timed once with an empty
  ``NUMBA_CACHE_DIR`` (cold), then, after one untimed job has filled that cache and
  waited for its compiles, ``--warm`` more times (the median is printed).
- **first-use calls**: for every (dtype, op) and route of ``--cases``, a job of its own on
  an empty cache: init, a barrier, then one call with ``timeout=--timeout`` seconds.
  Each rank reports whether it returned the right result (against numpy), raised, and
  how long the call took. A case passes when every rank returned the right result
  within the timeout.

Usage::

    python bench/core/cold_start.py                   # both, all 15 cases
    python bench/core/cold_start.py --skip-cases      # the first job only
    python bench/core/cold_start.py --skip-job --cases int8:product:small,float16:max:chunked
    python bench/core/cold_start.py --json out.json   # also every figure as JSON

Routes: ``small`` (an all_reduce of one slot), ``chunked`` (an all_reduce over several
chunks), ``reduce_scatter``. Exit status 1 if a case failed or a job failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = [
    f"{dt}:{op}:{route}"
    for route in ("small", "chunked", "reduce_scatter")
    for dt, op in (("int8", "product"), ("uint8", "sum"), ("int32", "sum"), ("float16", "max"), ("bool", "sum"))
]
#: Elements per rank of each route (the small all_reduce fits one slot of the arena).
COUNTS = {"small": 1000, "chunked": 1 << 20, "reduce_scatter": 1 << 19}


# -- the ranks ---------------------------------------------------------------------------------
def _inputs(dtype: str, count: int, rank: int) -> Any:
    """Rank ``rank``'s input: values that tell ranks and positions apart, and whose
    reductions stay exact in every dtype (float16 is given small integers)."""
    import numpy as np

    from ferrodist.core import dtype as ferrodist_dtype

    numpy_type = ferrodist_dtype(dtype).numpy
    positions = np.arange(count, dtype=np.int64)
    if dtype == "bool":
        return ((positions + rank) % 3 == 0).astype(numpy_type)
    values = (positions * 7 + rank * 13 + 1) % 61 - (0 if dtype.startswith("u") else 30)
    return values.astype(numpy_type)


def _expected(dtype: str, op: str, inputs: list[Any]) -> Any:
    """The reduction by numpy, in the array's own dtype (wrapping integers, as the
    kernels do; exact for these inputs in float16)."""
    import numpy as np

    ufunc = {"sum": np.add, "product": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    if dtype == "bool":
        ufunc = np.logical_or if op in ("sum", "max") else np.logical_and
    out = inputs[0].copy()
    for x in inputs[1:]:
        out = ufunc(out, x).astype(out.dtype)
    return out


def _rank_case(case: str, timeout: float, out_dir: str) -> None:
    import numpy as np

    import ferrodist.collectives as dist

    dtype, op, route = case.split(":")
    world = dist.init_process_group("shm")
    rank, size = world.rank, world.size
    count = COUNTS[route]
    if route == "reduce_scatter":
        inputs = [_inputs(dtype, count * size, r) for r in range(size)]
        whole = _expected(dtype, op, inputs)
        expected = whole[rank * count : (rank + 1) * count]
        x = inputs[rank].copy()
        result = np.zeros(count, x.dtype)
    else:
        inputs = [_inputs(dtype, count, r) for r in range(size)]
        expected = _expected(dtype, op, inputs)
        x = result = inputs[rank].copy()
    dist.barrier()
    start = time.perf_counter()
    error = None
    try:
        if route == "reduce_scatter":
            dist.reduce_scatter(result, x, op, timeout=timeout)
        else:
            dist.all_reduce(x, op, timeout=timeout)
    except Exception as exc:  # recorded: the point is what each rank saw
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    took = time.perf_counter() - start
    right = error is None and bool(np.array_equal(result.view(np.uint8), expected.view(np.uint8)))
    record = {"case": case, "rank": rank, "seconds": took, "error": error, "right": right}
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(record))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _rank_job(out_dir: str, wait: bool) -> None:
    import numpy as np

    import ferrodist.collectives as dist

    world = dist.init_process_group("shm")
    rank, size = world.rank, world.size
    for dtype in ("float32", "bfloat16"):
        for count in (1000, 600_000):  # one slot; several chunks
            inputs = [_inputs(dtype, count, r) for r in range(size)]
            x = inputs[rank].copy()
            dist.all_reduce(x)
            if not np.array_equal(x.astype(np.float64), _expected(dtype, "sum", inputs).astype(np.float64)):
                raise SystemExit(f"rank {rank}: wrong {dtype} all_reduce of {count}")
    y = np.arange(100_000, dtype=np.float32) * (rank + 1)
    dist.broadcast(y, 0)
    if not np.array_equal(y, np.arange(100_000, dtype=np.float32)):
        raise SystemExit(f"rank {rank}: wrong broadcast")
    if wait:
        _wait_for_compiles()
    dist.destroy_process_group()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "ok": True}))


def _wait_for_compiles() -> None:
    """Let the kernels this job queued finish compiling (so that the cache is warm)."""
    try:
        from ferrodist.core.kernels import wait_for_compiles
    except ImportError:  # a version that compiles inside the calls: nothing is pending
        return
    wait_for_compiles(timeout=600)


# -- the driver --------------------------------------------------------------------------------
def _launch(
    args: list[str], cache: str, out_dir: str, timeout: float = 600
) -> tuple[float, subprocess.CompletedProcess[bytes]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    command = [sys.executable, "-m", "ferrodist.launch", "run", "-n", "2", sys.executable, __file__, *args, out_dir]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, timeout=timeout)
    return time.perf_counter() - start, done


def first_job(warm_runs: int) -> dict[str, Any]:
    """Seconds of the first job on an empty cache, and the median of ``warm_runs`` warm."""
    with tempfile.TemporaryDirectory(prefix="ferrodist-cold-") as cache:
        with tempfile.TemporaryDirectory() as out:
            cold, done = _launch(["--rank-job"], cache, out)
            _check_job(done, out, "the cold job")
        with tempfile.TemporaryDirectory() as out:
            _, done = _launch(["--rank-job-wait"], cache, out)  # fills the cache, untimed
            _check_job(done, out, "the job that fills the cache")
        warm = []
        for _ in range(warm_runs):
            with tempfile.TemporaryDirectory() as out:
                took, done = _launch(["--rank-job"], cache, out)
                _check_job(done, out, "a warm job")
                warm.append(took)
    return {"cold_seconds": cold, "warm_seconds": statistics.median(warm), "warm_runs": warm}


def _check_job(done: subprocess.CompletedProcess[bytes], out: str, what: str) -> None:
    if done.returncode != 0 or len(list(Path(out).glob("rank-*.json"))) != 2:
        raise RuntimeError(
            f"{what} failed (exit {done.returncode}):\n{done.stdout.decode()[-3000:]}{done.stderr.decode()[-3000:]}"
        )


def first_use(case: str, timeout: float) -> dict[str, Any]:
    """One first-use case on an empty cache: what each rank saw."""
    with tempfile.TemporaryDirectory(prefix="ferrodist-cold-") as cache, tempfile.TemporaryDirectory() as out:
        took, done = _launch(["--rank-case", case, str(timeout)], cache, out)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank-*.json"))]
    passed = len(ranks) == 2 and all(r["right"] and r["seconds"] <= timeout for r in ranks)
    return {
        "case": case,
        "passed": passed,
        "job_seconds": took,
        "ranks": ranks,
        "exit": done.returncode,
        "output": "" if passed else (done.stdout.decode()[-2000:] + done.stderr.decode()[-2000:]),
    }


def _outcome(result: dict[str, Any]) -> str:
    ranks = result["ranks"]
    if len(ranks) < 2:
        return f"job failed (exit {result['exit']})"
    right = [r["right"] for r in ranks]
    if all(right):
        return "every rank right" + ("" if result["passed"] else " but past the timeout")
    if any(right):
        return "split: one rank right, the other raised"
    return "raised on every rank"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help="dtype:op:route,... (default: the 15 cases)")
    parser.add_argument("--timeout", type=float, default=4.0, help="each first-use call's timeout (seconds)")
    parser.add_argument("--warm", type=int, default=3, help="warm first jobs to time (median)")
    parser.add_argument("--skip-job", action="store_true", help="leave out the first-job measurement")
    parser.add_argument("--skip-cases", action="store_true", help="leave out the first-use cases")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()
    report: dict[str, Any] = {"cpus": os.cpu_count()}
    failed = False
    if not args.skip_job:
        job = first_job(args.warm)
        report["first_job"] = job
        print(
            f"first job (ferrodist run -n 2: init; float32 and bfloat16 all_reduce of 1000 and 600000; broadcast): "
            f"cold {job['cold_seconds']:.2f} s, warm {job['warm_seconds']:.2f} s "
            f"(median of {len(job['warm_runs'])}: {', '.join(f'{s:.2f}' for s in job['warm_runs'])})",
            flush=True,
        )
    if not args.skip_cases:
        results = []
        for case in args.cases.split(","):
            result = first_use(case, args.timeout)
            results.append(result)
            times = ", ".join(
                f"rank {r['rank']} {r['seconds']:.2f} s{'' if r['right'] else ' ' + (r['error'] or 'wrong result')[:80]}"
                for r in result["ranks"]
            )
            print(f"{case:28} {'ok  ' if result['passed'] else 'FAIL'} {_outcome(result)}: {times}", flush=True)
            if not result["passed"] and not result["ranks"]:
                print(result["output"], flush=True)
        report["cases"] = results
        passed = sum(r["passed"] for r in results)
        failed = passed < len(results)
        print(
            f"{passed} of {len(results)} first-use cases returned the right result on every rank within {args.timeout} s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-case":
        _rank_case(sys.argv[2], float(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] in ("--rank-job", "--rank-job-wait"):
        _rank_job(sys.argv[2], wait=sys.argv[1] == "--rank-job-wait")
    else:
        sys.exit(main())
