"""The figures of README.md and docs/: recorded by benchmark commands, rendered into the pages.

Every measured figure the pages show lives between two markers::

    <!-- figure: NAME -->
    ...generated text...
    <!-- /figure -->

and is rendered from the records in ``docs/figures/*.json`` by ``RENDERERS[NAME]``. A record
holds the JSON that a benchmark command wrote, for each of its runs, with the command, the
date and the machine: the pages quote the median over the runs, never the best one.

    python tools/figures.py record first_job         # run the command of a record (its runs), keep it
    python tools/figures.py record gpu --from-log ../shared/gpu-runs/2026-11-25-h100/gpu_check.log
    python tools/figures.py write                    # render every block into the pages
    python tools/figures.py check                    # 1 if a page differs from its records (tests run it)
    python tools/figures.py list                     # each record: its command, runs and date

Tables of measured figures outside the blocks are allowed only under a heading with
"History" in it (runs of earlier versions, kept as they were recorded); tests/test_docs.py
checks that too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "figures"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- figure: ([\w.-]+) -->\n)(.*?)(<!-- /figure -->)", re.S)


@dataclass(frozen=True)
class Source:
    """How a record is made: ``command`` (``{json}`` stands for the file it writes), run
    ``runs`` times in a row. ``needs``: what the machine must offer (said when missing)."""

    command: tuple[str, ...]
    runs: int = 1
    needs: str = ""


SOURCES: dict[str, Source] = {
    "all_reduce": Source(
        (
            "ferrodist", "bench", "-n", "2", "--backends", "shm", "--compare", "--ops", "all_reduce",
            "--max-bytes", "67108864", "--no-progress", "--json", "{json}",
        ),
        runs=3,
        needs="torch and mpi4py (make test installs them)",
    ),
    "collectives": Source(
        (
            "ferrodist", "bench", "-n", "2", "--backends", "shm,tcp,mpi", "--compare", "--startup",
            "--rounds", "3", "--no-progress", "--json", "{json}",
        ),
        needs="torch and mpi4py (make test installs them)",
    ),
    "first_job": Source(("python", "bench/torch/first_job.py", "--cold", "--json", "{json}"), runs=3, needs="torch"),
    "launchers": Source(("python", "bench/ddp/launchers.py", "--rounds", "5", "--json", "{json}"), needs="torch"),
    "torch_ddp": Source(
        ("torchrun", "--nproc-per-node", "2", "bench/torch/ddp_backends.py", "--rounds", "3", "--json", "{json}"),
        needs="torch",
    ),
    "ddp": Source(("python", "bench/ddp/run.py", "--rounds", "3", "--json", "{json}"), needs="torch"),
    "torch_suite": Source(("python", "bench/torch/suite.py", "--ranks", "4", "--json", "{json}"), needs="torch"),
    "recovery": Source(("python", "bench/elastic/recovery.py", "--json", "{json}"), runs=3, needs="torch"),
    "kernels": Source(("python", "bench/core/kernels.py", "--inplace", "--json", "{json}")),
    "crowded": Source(
        ("python", "bench/crowded.py", "--figures", "--json", "{json}"), runs=3, needs="torch and mpi4py"
    ),
    "two_nodes": Source(
        (
            "sudo", "python", "bench/levels/run.py", "--rate", "10gbit", "--sizes", "4K,64K,1M,64M",
            "--rounds", "7", "--json", "{json}",
        ),
        runs=3,
        needs="root (network namespaces), torch and Open MPI",
    ),
    "gpu": Source(("bash", "tools/gpu_check.sh"), needs="an NVIDIA GPU: record it with --from-log from the check's log"),
}  # fmt: skip


# -- records ------------------------------------------------------------------------------------
def load(name: str) -> dict[str, Any]:
    path = RECORDS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"no record {path.relative_to(ROOT)}: run `python tools/figures.py record {name}`")
    record: dict[str, Any] = json.loads(path.read_text())
    return record


def _machine() -> str:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores, {cpu or platform.processor() or platform.machine()}"


def record(name: str, runs: int | None, from_log: str | None, recorded: str | None = None, note: str = "") -> None:
    source = SOURCES[name]
    results: list[Any] = []
    if from_log is not None:
        if name != "gpu":
            raise SystemExit("--from-log is for the gpu record (the log of tools/gpu_check.sh)")
        results.append(_gpu_from_log(Path(from_log).read_text()))
        machine, command = results[0]["machine"], " ".join(source.command)
    else:
        machine = _machine()
        bin_dir = Path(sys.executable).parent
        for run in range(runs or source.runs):
            with tempfile.TemporaryDirectory() as scratch:
                out = Path(scratch) / "out.json"
                argv = [str(out) if part == "{json}" else part for part in source.command]
                argv = [sys.executable if part == "python" else part for part in argv]
                if argv[0] == "sudo" and os.geteuid() == 0:
                    argv = argv[1:]  # root already
                env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
                print(f"[{name} {run + 1}/{runs or source.runs}] {shlex.join(argv)}", flush=True)
                done = subprocess.run(argv, cwd=ROOT, env=env)
                if done.returncode != 0 or not out.exists():
                    raise SystemExit(f"{name}: the command failed (exit {done.returncode}); needs {source.needs}")
                results.append(json.loads(out.read_text()))
        command = " ".join(p for p in source.command if p not in ("--json", "{json}"))
    RECORDS.mkdir(parents=True, exist_ok=True)
    document = {
        "command": command,
        "recorded": recorded or datetime.date.today().isoformat(),
        "machine": machine,
        "note": note,
        "runs": results,
    }
    (RECORDS / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote docs/figures/{name}.json ({len(results)} runs)")


# -- formatting ---------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def ratio(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x" if value < 100 else f"{value:.0f}x"


def size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes} {unit}"
        nbytes //= 1024
    return f"{nbytes} TiB"


def provenance(*names: str) -> str:
    """The line under a table: the command of each record, its runs and date."""
    parts = []
    for name in names:
        rec = load(name)
        runs = len(rec["runs"])
        parts.append(
            f"`{rec['command']}` ({'the median of ' + str(runs) + ' runs' if runs > 1 else 'one run'}, {rec['recorded']})"
        )
    return "From " + "; ".join(parts) + "."


# -- the renderers --------------------------------------------------------------------------------
Renderer = Callable[[], str]
RENDERERS: dict[str, Renderer] = {}


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    def register(fn: Renderer) -> Renderer:
        RENDERERS[name] = fn
        return fn

    return register


def _bench_seconds(runs: Sequence[dict[str, Any]], library: str, op: str, nbytes: int) -> float | None:
    """The median over runs of ``library``'s time for ``op`` at ``nbytes`` (None if absent)."""
    found = [
        r["seconds"]
        for run in runs
        for r in run["records"]
        if r["library"] == library and r["op"] == op and r["bytes"] == nbytes
    ]
    return median(found) if found else None


@renderer("all_reduce")
def _all_reduce() -> str:
    rec = load("all_reduce")
    runs = rec["runs"]
    sizes = sorted({r["bytes"] for r in runs[0]["records"]})
    lines = [
        "| size | shm | mpi4py | Gloo | memory floor | mpi4py / shm | Gloo / shm | shm / floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for nbytes in sizes:
        shm, mpi, gloo, floor = (
            _bench_seconds(runs, lib, "all_reduce", nbytes) for lib in ("ferrodist:shm", "mpi4py", "gloo", "floor")
        )
        if shm is None:
            continue
        cells = [size(nbytes), duration(shm)]
        cells += [duration(x) if x else "-" for x in (mpi, gloo, floor)]
        cells += [ratio(x / shm) if x else "-" for x in (mpi, gloo)]
        cells.append(ratio(shm / floor) if floor else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + provenance("all_reduce") + "\n"


def _first_job_rows(cache: str) -> list[tuple[float, float, float]]:
    """Per job number: (ferrodist's median step, Gloo's, ferrodist's slowest tenth), each the
    median over the record's runs."""
    runs = load("first_job")["runs"]
    numbers = sorted({j["job"] for run in runs for j in run["jobs"] if j["cache"] == cache})
    rows = []

    def of(number: int, backend: str, key: str, reduce: Callable[[Any], float] = float) -> float:
        return median(
            [
                reduce(j[key])
                for run in runs
                for j in run["jobs"]
                if j["cache"] == cache and j["job"] == number and j["backend"] == backend
            ]
        )

    for number in numbers:
        rows.append(
            (
                of(number, "ferrodist", "median_ms"),
                of(number, "gloo", "median_ms"),
                of(number, "ferrodist", "tenths_ms", max),
            )
        )
    return rows


@renderer("first_job")
def _first_job() -> str:
    lines = [
        "| kernel cache | job | ferrodist median step | Gloo median step | Gloo / ferrodist | ferrodist's slowest tenth of the job |",
        "|---|---|---|---|---|---|",
    ]
    for cache, label in (("this install's", "warm (`ferrodist warm`, as `make demo` runs it)"), ("empty", "empty")):
        for number, (ours, gloo, tenth) in enumerate(_first_job_rows(cache), 1):
            lines.append(
                f"| {label} | {number} | {ours:.2f} ms | {gloo:.2f} ms | {ratio(gloo / ours)} | {tenth:.2f} ms |"
            )
    return "\n".join(lines) + "\n\n" + provenance("first_job") + "\n"


@renderer("torch_suite")
def _torch_suite() -> str:
    run = load("torch_suite")["runs"][0]
    gloo = run["runs"][0]
    lines = ["| backend | wall time | / Gloo's | passed | not passed |", "|---|---|---|---|---|"]
    for result in run["runs"]:
        name = "Gloo" if result["backend"] == "gloo" else f"ferrodist, `{result['transport']}`"
        missed = ", ".join(f"`{n}`" for n in result["not_passed"]) or "-"
        lines.append(
            f"| {name} | {result['seconds']:.1f} s | {ratio(result['seconds'] / gloo['seconds'])} | "
            f"{len(result['passed'])} of {result['tests']} | {missed} |"
        )
    return "\n".join(lines) + f"\n\nAt {run['ranks']} ranks. " + provenance("torch_suite") + "\n"


@renderer("recovery")
def _recovery() -> str:
    rec = load("recovery")
    runs = rec["runs"]
    first = runs[0]
    lines = [
        "| backend | path | kill -> the job's next step done | steps done again | whole job |",
        "|---|---|---|---|---|",
    ]
    rejoins = []
    for backend in first["backends"]:

        def typical(mode: str, key: str, backend: str = backend) -> float:
            return median([run["backends"][backend][mode][key] for run in runs])

        e, r = ("elastic", "restart")
        # two launchers in two network namespaces, the two levels: -n MIN:MAX counts each node's ranks
        label, shape = ("2 nodes x 2", "`-n 1:2` per node") if backend == "nodes" else (backend, "`-n 3:4`")
        lines.append(
            f"| {label} | in place ({shape}, `ferrodist.elastic`) | {duration(typical(e, 'recovery_s'))} | "
            f"{typical(e, 'redone_steps'):.0f} | {duration(typical(e, 'job_s'))} |"
        )
        lines.append(
            f"| {label} | restart (`--max-restarts 1`, a checkpoint every 10 steps) | "
            f"{duration(typical(r, 'recovery_s'))} | {typical(r, 'redone_steps'):.0f} | {duration(typical(r, 'job_s'))} |"
        )
        lines.append(
            f"| {label} | in place is | **{ratio(typical(r, 'recovery_s') / typical(e, 'recovery_s'))} faster** | | "
            f"{ratio(typical(r, 'job_s') / typical(e, 'job_s'))} faster |"
        )
        joined = [run["backends"][backend][e]["rejoin_s"] for run in runs if run["backends"][backend][e]["rejoin_s"]]
        if joined:
            rejoins.append(f"{label} {duration(median(joined))}")
    said = (
        f"{first['ranks']} ranks, DDP on a 2.1 M-parameter MLP, {first['steps']} steps; rank {first['victim']} "
        f"killed (`kill -9`) at step {first['kill_at']}. In place, the launcher's replacement for it joined the "
        f"survivors at a commit point, with the state from a peer, this long after its process started: "
        f"{', '.join(rejoins) or 'it did not join before the end'}."
    )
    if "nodes" in first["backends"]:
        said += (
            " 2 nodes x 2: two network namespaces joined by a veth pair (the command needs root), one launcher each, "
            f"ranks 0-1 on node 0 and 2-3 on node 1: the replacement of rank {first['victim']} starts on its node."
        )
    return "\n".join(lines) + "\n\n" + said + " " + provenance("recovery") + "\n"


@renderer("launchers")
def _launchers() -> str:
    rec = load("launchers")
    run = rec["runs"][0]
    results = run["results"]
    reference = median(results["torchrun"]["step"])
    lines = ["| launcher | median step | median job | step / torchrun's |", "|---|---|---|---|"]
    for name in ("ferrodist run", "torchrun"):
        step, job = median(results[name]["step"]), median(results[name]["job"])
        lines.append(f"| `{name}` | {step * 1e3:.2f} ms | {job:.2f} s | {ratio(step / reference)} |")
    omp = run["omp_num_threads"]
    said = "not set" if omp == "not set" else f"set to {omp}"
    return "\n".join(lines) + f"\n\nOMP_NUM_THREADS {said} where the commands ran. " + provenance("launchers") + "\n"


COLLECTIVE_ROWS = (
    ("all_reduce", 4 << 10),
    ("all_reduce", 1 << 20),
    ("all_reduce", 64 << 20),
    ("broadcast", 64 << 20),
    ("all_gather", 64 << 20),
    ("reduce_scatter", 64 << 20),
)


def _faster(reference: float, ours: float) -> str:
    return f"{ratio(reference / ours)} faster" if reference >= ours else f"{ratio(ours / reference)} slower"


@renderer("collectives")
def _collectives() -> str:
    runs = load("collectives")["runs"]
    lines = [
        "| collective, size | ferrodist shm | ferrodist tcp | Gloo | mpi4py | shm vs Gloo | shm vs mpi4py |",
        "|---|---|---|---|---|---|---|",
    ]
    for op, nbytes in COLLECTIVE_ROWS:
        shm, tcp, gloo, mpi = (
            _bench_seconds(runs, lib, op, nbytes) for lib in ("ferrodist:shm", "ferrodist:tcp", "gloo", "mpi4py")
        )
        if shm is None:
            continue
        cells = [f"{op} {size(nbytes)}", *(duration(x) if x else "-" for x in (shm, tcp, gloo, mpi))]
        cells += [_faster(x, shm) if x else "-" for x in (gloo, mpi)]
        lines.append("| " + " | ".join(cells) + " |")
    starts = [run.get("startup_seconds", {}) for run in runs]
    if all(starts):

        def start(name: str) -> float:
            return median([s[name] for s in starts])

        ours, torch, mpi = start("ferrodist run"), start("torchrun (gloo)"), start("mpiexec + mpi4py")
        lines.append(
            f"| launch + init + one all_reduce + exit | {duration(ours)} (`ferrodist run`) | | "
            f"{duration(torch)} (torchrun) | {duration(mpi)} (mpiexec) | {_faster(torch, ours)} | {_faster(mpi, ours)} |"
        )
    return "\n".join(lines) + "\n\n" + provenance("collectives") + "\n"


@renderer("torch_ddp")
def _torch_ddp() -> str:
    run = load("torch_ddp")["runs"][0]
    steps = {name: median(values) for name, values in run["steps"].items()}
    lines = ["| configuration | step | vs DDP over Gloo, same options |", "|---|---|---|"]
    for name, seconds in steps.items():
        baseline = "DDP over gloo, gradient_as_bucket_view" if "gradient_as_bucket_view" in name else "DDP over gloo"
        lines.append(f"| {name} | {duration(seconds)} | {ratio(steps[baseline] / seconds)} |")
    alone = ", ".join(f"{name} {duration(median(v))}" for name, v in run["all_reduce"].items())
    return (
        "\n".join(lines)
        + f"\n\nOne all_reduce of the gradients' 100.7 MB, alone: {alone}. "
        + provenance("torch_ddp")
        + "\n"
    )


@renderer("ddp")
def _ddp() -> str:
    run = load("ddp")["runs"][0]
    batches = list(run)
    small, large = batches[0], batches[1]
    gloo = "torch DDP, Gloo"
    one = "floor: 1 rank, no DDP"
    lines = [
        "| configuration | batch 8 per rank | vs Gloo | / 1 rank | batch 256 per rank | vs Gloo |",
        "|---|---|---|---|---|---|",
    ]
    for name in run[small]:
        a, b = median(run[small][name]), median(run[large][name])
        lines.append(
            f"| {name} | {duration(a)} | {ratio(median(run[small][gloo]) / a)} | {a / median(run[small][one]):.2f} "
            f"| {duration(b)} | {ratio(median(run[large][gloo]) / b)} |"
        )
    return "\n".join(lines) + "\n\n" + provenance("ddp") + "\n"


@renderer("kernels")
def _kernels() -> str:
    run = load("kernels")["runs"][0]
    lines = [
        "| case | ferrodist (ms) | plain Numba loop | numpy chained | copy floor | numpy / ferrodist | ferrodist / floor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for row in run["rows"]:
        numpy = row.get("numpy")
        lines.append(
            f"| {row['case']} | {cell(row['ferrodist'])} | {cell(row['plain'])} | {cell(numpy)} | "
            f"{cell(row['floor'])} | {ratio(numpy / row['ferrodist']) if numpy else '-'} | "
            f"{row['ferrodist'] / row['floor']:.2f} |"
        )
    return "\n".join(lines) + "\n\n" + provenance("kernels") + "\n"


@renderer("crowded")
def _crowded() -> str:
    """The small call in each crowd against mpi4py and Gloo, and the communication-bound DDP
    step against Gloo in the crowded ones: medians over the runs, the slowest and fastest run
    of the small call beside them."""
    runs = load("crowded")["runs"]
    lines = [
        "| 4 KiB all_reduce | shm | mpi4py | Gloo | mpi4py / shm | runs of shm | runs of mpi4py |",
        "|---|---|---|---|---|---|---|",
    ]
    for crowd in runs[0]["small_call"]:
        sweeps = [run["small_call"][crowd]["records"] for run in runs]
        times = {
            lib: [r["seconds"] for records in sweeps for r in records if r["library"] == lib and r["bytes"] == 4096]
            for lib in ("ferrodist:shm", "mpi4py", "gloo")
        }
        shm, mpi, gloo = (median(times[lib]) if times[lib] else None for lib in ("ferrodist:shm", "mpi4py", "gloo"))
        if shm is None:
            continue

        def spread(values: list[float]) -> str:
            return f"{duration(min(values))} - {duration(max(values))}" if values else "-"

        cells = [crowd, duration(shm), duration(mpi) if mpi else "-", duration(gloo) if gloo else "-"]
        cells += [ratio(mpi / shm) if mpi else "-", spread(times["ferrodist:shm"]), spread(times["mpi4py"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| DDP, batch 8 per rank | Gloo | ferrodist DDP, shm | vs Gloo | ferrodist DDP, tcp | vs Gloo |",
        "|---|---|---|---|---|---|",
    ]
    for crowd in runs[0]["ddp"]:
        steps: dict[str, list[float]] = {}
        for run in runs:
            for batch in run["ddp"][crowd].values():
                for name, values in batch.items():
                    steps.setdefault(name, []).extend(values)
        gloo, shm, tcp = (median(steps[n]) for n in ("torch DDP, Gloo", "ferrodist DDP, shm", "ferrodist DDP, tcp"))
        lines.append(
            f"| {crowd} | {duration(gloo)} | {duration(shm)} | {ratio(gloo / shm)} | {duration(tcp)} | {ratio(gloo / tcp)} |"
        )
    return "\n".join(lines) + "\n\n" + provenance("crowded") + "\n"


def _two_nodes_times(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """(library, bytes) -> the all_reduce's median time over the runs."""
    found: dict[tuple[str, int], list[float]] = {}
    for run in runs:
        for r in run["records"]:
            if r["op"] == "all_reduce":
                found.setdefault((r["library"], r["bytes"]), []).append(r["seconds"])
    return {key: median(values) for key, values in found.items()}


def _shaping(text: str) -> str:
    """tc's shaping as the benchmark said it, without the kernel's error text."""
    return text.split(" (no delay")[0] + (", no delay (this kernel has no netem)" if "no netem" in text else "")


def _two_nodes_table(full: bool) -> str:
    rec = load("two_nodes")
    run = rec["runs"][0]
    by = _two_nodes_times(rec["runs"])
    floors = {int(n): s for n, s in run["all_reduce_floor"].items()}
    names = (
        ("ferrodist:levels", "two levels"),
        ("ferrodist:tcp", "flat tcp"),
        ("gloo", "Gloo"),
        ("mpi4py", "Open MPI"),
    )
    head = [name for _, name in names] + ["link floor"]
    if full:
        head += ["flat tcp / two levels", "Gloo / two levels", "Open MPI / two levels", "two levels / floor"]
    lines = ["| size | " + " | ".join(head) + " |", "|" + "---|" * (len(head) + 1)]
    for nbytes in sorted({n for _, n in by}):
        ours = by.get(("ferrodist:levels", nbytes))
        if ours is None:
            continue
        times = [by.get((lib, nbytes)) for lib, _ in names]
        floor = floors.get(nbytes)
        cells = [size(nbytes), *(duration(t) if t else "-" for t in times), duration(floor) if floor else "-"]
        if full:
            cells += [ratio(t / ours) if t else "-" for t in times[1:]]
            cells.append(ratio(ours / floor) if floor else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "\n".join(lines)
        + f"\n\n2 nodes x {run['ranks_per_node']} ranks, float32, link: {_shaping(run['shaping'])}. "
        + provenance("two_nodes")
        + "\n"
    )


@renderer("two_nodes")
def _two_nodes() -> str:
    return _two_nodes_table(full=True)


@renderer("two_nodes.short")
def _two_nodes_short() -> str:
    return _two_nodes_table(full=False)


@renderer("gpu")
def _gpu() -> str:
    rec = load("gpu")
    run = rec["runs"][0]
    lines = [
        "| size | ferrodist, staged | floor: the copies and the CPU all_reduce by hand | ferrodist / floor | Gloo | Gloo / ferrodist |",
        "|---|---|---|---|---|---|",
    ]
    for row in run["all_reduce"]:
        lines.append(
            f"| {row['size']} | {duration(row['ferrodist'])} | {duration(row['floor'])} | "
            f"{row['ferrodist'] / row['floor']:.2f} | {duration(row['gloo'])} | {ratio(row['gloo'] / row['ferrodist'])} |"
        )
    kernels = ", ".join(
        f"{k['dtype']} {k['ferrodist']:.0f} GB/s against torch `add_`'s {k['torch']:.0f} ({k['ferrodist'] / k['torch']:.2f}x)"
        for k in run["kernels"]
    )
    return (
        "\n".join(lines)
        + f"\n\n`reduce_into` (dst += src, 64 Mi elements): {kernels}. {run['machine']}, 2 processes sharing it; "
        + f"from the log of `{rec['command']}` ({rec['recorded']}). {rec.get('note', '')}".rstrip()
        + "\n"
    )


def _gpu_from_log(text: str) -> dict[str, Any]:
    """The figures of a ``tools/gpu_check.sh`` log: its all_reduce table (rank 0's lines) and
    its kernel rows, with the GPU's name."""

    def seconds(cell: str) -> float:
        value, unit = cell.split()
        return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]

    rows, kernels, machine = [], [], ""
    for line in text.splitlines():
        line = line.removeprefix("[rank 0] ").strip()
        gpu = re.search(r"\((NVIDIA [^)]+)\)", line)
        if gpu and not machine:
            machine = gpu.group(1)
        cells = [c.strip() for c in line.strip("|").split("|")] if line.startswith("|") else []
        if len(cells) == 6 and re.fullmatch(r"\d+ [KMG]iB", cells[0]):
            rows.append(
                {
                    "size": cells[0],
                    "ferrodist": seconds(cells[1]),
                    "floor": seconds(cells[2]),
                    "gloo": seconds(cells[4]),
                }
            )
        elif len(cells) == 4 and cells[1].endswith("GB/s") and cells[2].endswith("GB/s"):
            kernels.append(
                {"dtype": cells[0], "ferrodist": float(cells[1].split()[0]), "torch": float(cells[2].split()[0])}
            )
    if not rows:
        raise SystemExit("the log holds no all_reduce table of bench/gpu/all_reduce.py")
    return {"machine": machine or "a GPU", "all_reduce": rows, "kernels": kernels}


def _vs(ours: float, theirs: float) -> str:
    """How ``theirs`` compares with ``ours`` (times): "2.31x faster" means ferrodist is."""
    return f"**{ratio(theirs / ours)} faster**" if theirs >= ours else f"{ratio(ours / theirs)} slower"


@renderer("headline")
def _headline() -> str:
    """The README's few figures: one line each, ferrodist's time, the reference's, and which is
    faster; the commands below."""
    rows: list[tuple[str, str, str, str]] = []
    sweep = load("all_reduce")["runs"]
    for nbytes in (4 << 10, 1 << 20, 64 << 20):
        shm = _bench_seconds(sweep, "ferrodist:shm", "all_reduce", nbytes)
        assert shm is not None
        for lib, label in (("mpi4py", "mpi4py (Open MPI)"), ("gloo", "torch.distributed (Gloo)")):
            theirs = _bench_seconds(sweep, lib, "all_reduce", nbytes)
            if theirs:
                rows.append(
                    (
                        f"all_reduce {size(nbytes)}, one host [1]",
                        duration(shm),
                        f"{label} {duration(theirs)}",
                        _vs(shm, theirs),
                    )
                )
    warm = _first_job_rows("this install's")[0]
    cold = _first_job_rows("empty")[0]
    rows.append(
        (
            "torch DDP, small MLP: the first job after `make demo` [2]",
            f"{warm[0]:.2f} ms a step",
            f"Gloo {warm[1]:.2f} ms",
            _vs(warm[0], warm[1]),
        )
    )
    rows.append(
        (
            "the same, first job on an empty kernel cache [2]",
            f"{cold[0]:.2f} ms a step",
            f"Gloo {cold[1]:.2f} ms",
            _vs(cold[0], cold[1]),
        )
    )
    steps = {name: median(v) for name, v in load("torch_ddp")["runs"][0]["steps"].items()}
    ours = next(v for k, v in steps.items() if k.startswith("DDP over ferrodist (shm") and "view" not in k)
    rows.append(
        (
            "torch DDP, 25 M parameters, batch 8 [3]",
            f"{duration(ours)} a step",
            f"Gloo {duration(steps['DDP over gloo'])}",
            _vs(ours, steps["DDP over gloo"]),
        )
    )
    by = _two_nodes_times(load("two_nodes")["runs"])
    for nbytes in (4 << 10, 64 << 20):
        mine, mpi = by.get(("ferrodist:levels", nbytes)), by.get(("mpi4py", nbytes))
        if mine and mpi:
            rows.append(
                (
                    f"all_reduce {size(nbytes)}, two nodes at 10 Gbit/s [4]",
                    duration(mine),
                    f"Open MPI {duration(mpi)}",
                    _vs(mine, mpi),
                )
            )
    starts = [run["startup_seconds"] for run in load("collectives")["runs"]]
    ours_start = median([s["ferrodist run"] for s in starts])
    for name, label in (("torchrun (gloo)", "torchrun"), ("mpiexec + mpi4py", "mpiexec")):
        theirs = median([s[name] for s in starts])
        rows.append(
            (
                "launch, init, one all_reduce, exit [5]",
                duration(ours_start),
                f"{label} {duration(theirs)}",
                _vs(ours_start, theirs),
            )
        )
    recovery = load("recovery")["runs"]
    in_place = median([run["backends"]["shm"]["elastic"]["recovery_s"] for run in recovery])
    restart = median([run["backends"]["shm"]["restart"]["recovery_s"] for run in recovery])
    rows.append(
        (
            "a rank killed in a 4-rank DDP job: the kill to the next step [6]",
            f"{duration(in_place)} (shrink in place)",
            f"a restart {duration(restart)}",
            _vs(in_place, restart),
        )
    )
    lines = ["| what (2 ranks, float32) | ferrodist | against | ferrodist is |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    notes = []
    for number, name in enumerate(("all_reduce", "first_job", "torch_ddp", "two_nodes", "collectives", "recovery"), 1):
        rec = load(name)
        runs = len(rec["runs"])
        how = f"the median of {runs} runs" if runs > 1 else "one run"
        notes.append(f"[{number}] `{rec['command']}` ({how}, {rec['recorded']})")
    return "\n".join(lines) + "\n\n" + "<br>\n".join(notes) + "\n"


# -- the pages -----------------------------------------------------------------------------------
def render(name: str) -> str:
    if name not in RENDERERS:
        raise SystemExit(f"no renderer for figure {name!r} (tools/figures.py RENDERERS)")
    return RENDERERS[name]()


def rendered(text: str) -> str:
    """``text`` with every figure block rendered afresh."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def differences() -> list[str]:
    """The pages whose figure blocks differ from what their records render."""
    return [str(page.relative_to(ROOT)) for page in PAGES if rendered(page.read_text()) != page.read_text()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run a record's command and keep what it wrote")
    rec.add_argument("name", choices=sorted(SOURCES))
    rec.add_argument("--runs", type=int, default=None, help="runs instead of the record's own number")
    rec.add_argument("--from-log", default=None, help="gpu: read the figures from tools/gpu_check.sh's log")
    rec.add_argument("--recorded", default=None, help="the day of the run (default today; for --from-log)")
    rec.add_argument("--note", default="", help="what the pages should say with the figures (which code ran)")
    commands.add_parser("write", help="render every figure block into the pages")
    commands.add_parser("check", help="exit 1 if a page's figures differ from its records")
    commands.add_parser("list", help="the records: command, runs, date")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.name, args.runs, args.from_log, args.recorded, args.note)
    elif args.command == "write":
        for page in PAGES:
            text = page.read_text()
            new = rendered(text)
            if new != text:
                page.write_text(new)
                print(f"wrote {page.relative_to(ROOT)}")
    elif args.command == "check":
        stale = differences()
        for page in stale:
            print(f"{page}: its figures differ from docs/figures (python tools/figures.py write)")
        return 1 if stale else 0
    else:
        for name in sorted(SOURCES):
            path = RECORDS / f"{name}.json"
            if path.exists():
                rec = json.loads(path.read_text())
                print(f"{name}: {len(rec['runs'])} runs, {rec['recorded']}, {rec['machine']}: {rec['command']}")
            else:
                print(f"{name}: not recorded ({' '.join(SOURCES[name].command)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
