"""``ferrodist bench``: a collective sweep in the style of nccl-tests, with comparisons.

For each library (ferrodist's backends, and with ``compare`` torch.distributed's Gloo and
mpi4py on Open MPI, all in the same invocation), each collective and each size, a job of
N ranks measures the median time of one call; the report gives the time, the algorithm
bandwidth (bytes / time) and the bus bandwidth (nccl-tests' formula per collective), and
the ratio of each reference's time to ferrodist's, and ferrodist's time over the memory
floor (every rank at once reading and writing what the collective must, with numpy).
"""

from __future__ import annotations

import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ferrodist.launch._run import run

__all__ = ["FLOOR", "MATPLOTLIB", "BenchSpec", "busbw", "startup", "sweep"]

FERRODIST = ("ferrodist:shm", "ferrodist:shm-shared", "ferrodist:tcp", "ferrodist:mpi")
REFERENCES = ("gloo", "mpi4py")
#: Not a library: every rank streams the bytes the collective must read and write (numpy).
FLOOR = "floor"
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class BenchSpec:
    nprocs: int = 2
    libraries: Sequence[str] = ("ferrodist:shm",)
    ops: Sequence[str] = OPS
    sizes: Sequence[int] = tuple(4096 * 4**i for i in range(10))  # 4 KiB .. 1 GiB capped below
    dtype: str = "float32"
    rounds: int = 5
    passes: int = 1
    target: float = 0.05
    #: seconds each collective runs at the first size before anything is timed
    warmup: float = 0.2
    skipped: dict[str, str] = field(default_factory=dict)


def busbw(op: str, nbytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth in GB/s (bytes: the input of all_reduce/broadcast/reduce_scatter,
    the output of all_gather)."""
    algbw = nbytes / seconds / 1e9
    factor = {"all_reduce": 2 * (ranks - 1) / ranks, "broadcast": 1.0}.get(op, (ranks - 1) / ranks)
    return algbw * factor


def _mpiexec() -> str | None:
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def _mpiexec_args() -> list[str]:
    args = ["--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.insert(0, "--allow-run-as-root")
    return args


def available(library: str, dtype: str = "float32") -> str | None:
    """Why ``library`` cannot run here (or not with ``dtype``), or ``None`` if it can."""
    if library == "mpi4py" and dtype in ("bfloat16", "float16"):
        return f"MPI has no {dtype} reductions"
    uses_mpi = library in ("ferrodist:mpi", "mpi4py")
    if uses_mpi:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "mpi4py is not installed (pip install -e './packages/transport[mpi]' from a clone of ferrodist)"
        if _mpiexec() is None:
            return "mpiexec is not on PATH"
    if library == "gloo":
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            return "torch is not installed (pip install torch)"
    return None


#: How to get matplotlib, for ``bench --plot`` and ``trace --png`` (the launch package's
#: ``bench`` extra brings it too).
MATPLOTLIB = "pip install matplotlib"


def plot_unavailable() -> str | None:
    """Why ``--plot`` cannot draw here (matplotlib is missing), or ``None`` if it can."""
    import importlib.util

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # a module without a spec: importable, say
        found = True
    if not found:
        return f"matplotlib is not installed ({MATPLOTLIB})"
    return None


def _run_library(library: str, spec: BenchSpec, progress: Callable[[], None]) -> list[dict[str, Any]]:
    worker = [sys.executable, "-m", "ferrodist.launch._bench.worker"]
    payload = json.dumps(
        {
            "ops": list(spec.ops),
            "sizes": list(spec.sizes),
            "dtype": spec.dtype,
            "rounds": spec.rounds,
            "target": spec.target,
            "warmup": spec.warmup,
        }
    )
    with tempfile.TemporaryDirectory(prefix="ferrodist-bench-") as tmp:
        out = os.path.join(tmp, "results.jsonl")
        command = [*worker, library, out, payload]
        log = _ProgressSink(progress)
        if library in ("ferrodist:mpi", "mpi4py"):
            mpiexec = _mpiexec()
            assert mpiexec is not None
            proc = subprocess.Popen(
                [mpiexec, *_mpiexec_args(), "-n", str(spec.nprocs), *command],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
            code = proc.wait()
        else:
            code = run(spec.nprocs, command, out=log).exit_code  # type: ignore[arg-type]
        if code != 0:
            raise RuntimeError(f"ferrodist bench: {library} failed (exit {code}):\n{log.text()[-3000:]}")
        with open(out) as results:
            return [json.loads(line) for line in results if line.strip()]


class _ProgressSink(io.RawIOBase):
    """Collects a job's output and ticks the progress bar on ``progress`` lines."""

    def __init__(self, tick: Callable[[], None]) -> None:
        self._tick = tick
        self._lines: list[bytes] = []

    def write(self, data: Any) -> int:
        for line in bytes(data).splitlines():
            if b"progress " in line:
                self._tick()
            else:
                self._lines.append(line)
        return len(data)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return b"\n".join(self._lines).decode(errors="replace")


def sweep(spec: BenchSpec, *, show_progress: bool = True) -> list[dict[str, Any]]:
    """Run every library of ``spec`` and return all measurements (skipping what cannot run).

    With ``passes`` > 1 the libraries run again, in the reverse order every other pass, and
    each (library, op, size) keeps its fastest median: a shared machine's slow spell then
    does not land on one library only. Every library is treated alike.
    """
    runnable = []
    for library in spec.libraries:
        why = available(library, spec.dtype)
        if why is None:
            runnable.append(library)
        else:
            spec.skipped[library] = why
    passes = max(1, spec.passes)
    total = passes * len(runnable) * len(spec.ops) * len(spec.sizes)
    bar = _bar(total, show_progress)
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    for number in range(passes):
        for library in runnable if number % 2 == 0 else reversed(runnable):
            bar.set_description(library)
            for record in _run_library(library, spec, lambda: bar.update(1)):
                key = (record["library"], record["op"], record["bytes"])
                if key not in best or record["seconds"] < best[key]["seconds"]:
                    best[key] = {**record, "passes": passes}
    bar.close()
    order = {library: i for i, library in enumerate(runnable)}
    ops = list(spec.ops)
    return sorted(best.values(), key=lambda r: (order[r["library"]], ops.index(r["op"]), r["bytes"]))


def _bar(total: int, show: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not show:

        class _Quiet:
            def update(self, _n: int) -> None: ...

            def set_description(self, _s: str) -> None: ...

            def close(self) -> None: ...

        return _Quiet()
    return tqdm(total=total, unit="measurement", file=sys.stderr)


def startup(nprocs: int = 2, repeats: int = 5) -> dict[str, float]:
    """Median wall time of launch + init + one all_reduce + exit, per launcher (ferrodist's with
    its Numba cache warm, and once with it empty).

    A job's first call never waits for a compiler: it runs an interpreted path while the
    kernel compiles in the background, and a job that ends first leaves the cache without it.
    So before the warm runs, one untimed job waits for its compiles (the cache then holds
    every kernel the job uses); the cold run gets an empty cache of its own."""
    job = "import numpy as np, ferrodist.collectives as d; d.init_process_group(); x = np.ones(4); d.all_reduce(x); "
    done = "assert x[0] == d.get_world_size(); d.destroy_process_group()"
    fill = "from ferrodist.core.kernels import wait_for_compiles; assert wait_for_compiles(240); "

    def ferrodist_run(script: str) -> list[str]:
        return [sys.executable, "-m", "ferrodist.launch", "run", "-n", str(nprocs), sys.executable, "-c", script]

    commands: dict[str, list[str]] = {"ferrodist run": ferrodist_run(job + done)}
    if available("gloo") is None:
        torch_script = (
            "import torch, torch.distributed as d; d.init_process_group('gloo'); x = torch.ones(4); "
            "d.all_reduce(x); d.destroy_process_group()"
        )
        commands["torchrun (gloo)"] = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nprocs),
            "--no-python",
            sys.executable,
            "-c",
            torch_script,
        ]
    if available("mpi4py") is None:
        mpi_script = (
            "from mpi4py import MPI; import numpy as np; x = np.ones(4); MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x)"
        )
        mpiexec = _mpiexec()
        assert mpiexec is not None
        commands["mpiexec + mpi4py"] = [mpiexec, *_mpiexec_args(), "-n", str(nprocs), sys.executable, "-c", mpi_script]
    _timed("ferrodist run (filling the Numba cache)", ferrodist_run(job + fill + done))
    result = {}
    for name, command in commands.items():
        result[name] = statistics.median(_timed(name, command) for _ in range(repeats))
    # Once more with an empty Numba cache: the shared-memory waits compile during init, the
    # all_reduce runs its interpreted path while its kernels compile in the background.
    with tempfile.TemporaryDirectory(prefix="ferrodist-cold-cache-") as cache:
        result["ferrodist run (cold Numba cache)"] = _timed(
            "ferrodist run (cold)", commands["ferrodist run"], {**os.environ, "NUMBA_CACHE_DIR": cache}
        )
    return result


def _timed(name: str, command: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, timeout=300, env=env)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(
            f"ferrodist bench --startup: {name} failed:\n{done.stdout.decode()[-2000:]}{done.stderr.decode()[-2000:]}"
        )
    return took


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
