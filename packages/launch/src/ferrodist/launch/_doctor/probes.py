"""What ``ferrodist doctor`` looks at: one probe per section, each returning a plain dict.

The probes here run in the doctor's process (each in a thread the doctor abandons at its
deadline): versions, Numba's kernel cache, the CPU's vector width, ``/dev/shm``, the network,
the launcher variables. The native libraries that can block while loading (an MPI library,
the CUDA driver, NCCL) are probed in child processes, which ``child_section`` kills at their
deadline: see ``children``. A probe may raise; the doctor turns that into a line.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import socket
import sys
import tempfile
from typing import Any

Section = dict[str, Any]

SHM_DIR = "/dev/shm"
#: The shared-memory arena of ``ferrodist.transport.ShmTransport``: per rank, 8 cache lines
#: of counters and FERRODIST_SHM_SLOTS slots (default 2, 1..6) of FERRODIST_SHM_CHUNK bytes
#: (default 1 MiB, a multiple of 64).
SHM_CHUNK, SHM_SLOTS, SHM_COUNTER_BYTES = 1 << 20, 2, 8 * 64

#: x86 SIMD levels, widest first (LLVM's feature names).
_X86_LEVELS = ("avx512f", "avx2", "avx", "sse4.2", "sse4.1", "ssse3", "sse3", "sse2")
_ARM_LEVELS = ("sve2", "sve", "neon")
#: Packed single-precision adds (what the float32 sum kernel's loop is made of) and the
#: register they use: xmm 128, ymm 256, zmm 512 bits.
_PACKED_ADD = re.compile(r"^\s*v?addps\s+.*%([xyz])mm\d+", re.MULTILINE)
_REGISTER_BITS = {"x": 128, "y": 256, "z": 512}


def version_of(distribution: str) -> str | None:
    """The installed version of ``distribution`` (read from its metadata, nothing imported)."""
    import importlib.metadata  # here: `ferrodist run` imports this module and need not wait for it

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed(module: str) -> bool:
    """Whether ``module`` can be found (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def python_section() -> Section:
    return {
        "version": platform.python_version(),
        "version_info": list(sys.version_info[:3]),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
    }


def numpy_section() -> Section:
    import numpy

    return {"version": numpy.__version__}


def writable_directory(path: str) -> bool:
    """Whether a file can be made in ``path`` (made if missing), as Numba itself checks."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def numba_section() -> Section:
    """Numba's version and where ferrodist.core's kernels are cached on disk.

    Numba caches a function in ``NUMBA_CACHE_DIR`` when that is set and writable, else beside
    its source file, else in a per-user directory, and compiles it afresh in every process
    when none is writable.
    """
    import llvmlite
    import numba
    from numba.core import caching, config

    from ferrodist.core.kernels import PLAIN, SUM, fold_kernel

    kernel = fold_kernel(PLAIN, SUM, False, -1).py_func
    requested = config.CACHE_DIR or None  # type: ignore[attr-defined]  # NUMBA_CACHE_DIR
    section: Section = {
        "version": numba.__version__,
        "llvmlite": llvmlite.__version__,
        "cache_dir_requested": requested,
        "cache_dir_requested_writable": writable_directory(requested) if requested else None,
    }
    try:
        path = caching.FunctionCache(kernel).cache_path
    except RuntimeError as exc:  # Numba found no writable place
        section.update(cache_dir=None, cache_writable=False, cache_where=None, cache_error=str(exc))
        return section
    beside = os.path.join(os.path.dirname(os.path.abspath(kernel.__code__.co_filename)), "__pycache__")
    if requested and os.path.abspath(path).startswith(os.path.abspath(requested)):
        where = "NUMBA_CACHE_DIR"
    elif os.path.abspath(path) == beside:
        where = "beside ferrodist.core"
    else:
        where = "Numba's per-user cache"
    section.update(cache_dir=path, cache_writable=writable_directory(path), cache_where=where)
    return section


def kernels_section() -> Section:
    """How many of the kernels ``ferrodist warm`` compiles (its defaults) the disk cache holds:
    a job compiles the missing ones beside its first steps, which are slower until then."""
    from ferrodist.core.kernels import cached
    from ferrodist.launch._warm import DEFAULT_DTYPES, DEFAULT_RANKS, kernel_list

    held, total = cached(kernel_list(DEFAULT_DTYPES, DEFAULT_RANKS))
    return {"cached": held, "total": total, "dtypes": list(DEFAULT_DTYPES), "ranks": DEFAULT_RANKS}


def kernel_vector_bits() -> int | None:
    """The widest vector register in the loop of ferrodist.core's float32 sum kernel, read from
    its machine code (compiled afresh: Numba shows no machine code for cached kernels); 0 when
    the loop is scalar, ``None`` on a CPU other than x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    import numpy as np
    from numba import typeof, types

    from ferrodist.core.kernels import PLAIN, SUM, fold_kernel, jit

    fresh = jit(cache=False)(fold_kernel(PLAIN, SUM, False, -1).py_func)
    array = typeof(np.empty(1, np.float32))
    signature = (array, types.UniTuple(array, 2), types.float64)
    fresh.compile(signature)
    registers = _PACKED_ADD.findall(fresh.inspect_asm(signature))
    return max((_REGISTER_BITS[r] for r in registers), default=0)


def cpu_section() -> Section:
    """The CPU LLVM sees, its SIMD level, and the vector width the kernels compile to."""
    from llvmlite import binding
    from numba.core import config

    features = binding.get_host_cpu_features()
    levels = _X86_LEVELS if platform.machine().lower() in ("x86_64", "amd64") else _ARM_LEVELS
    present = [level for level in levels if features.get(level, False)]
    return {
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "name": binding.get_host_cpu_name(),
        "target": config.CPU_NAME or None,  # type: ignore[attr-defined]  # NUMBA_CPU_NAME
        "simd": present[0] if present else None,
        "simd_features": present[::-1],
        "kernel_vector_bits": kernel_vector_bits(),
    }


def shm_section(nprocs: int) -> Section:
    """``/dev/shm`` and where a job of ``nprocs`` ranks would put its shared-memory arena."""
    env = os.environ
    section: Section = {"directory": SHM_DIR, "ranks": nprocs, "settings_error": None}
    chunk_text = env.get("FERRODIST_SHM_CHUNK", str(SHM_CHUNK))
    slots_text = env.get("FERRODIST_SHM_SLOTS", str(SHM_SLOTS))
    try:
        chunk, slots = int(chunk_text), int(slots_text)
    except ValueError:
        chunk, slots = SHM_CHUNK, SHM_SLOTS
        section["settings_error"] = f"FERRODIST_SHM_CHUNK={chunk_text!r}, FERRODIST_SHM_SLOTS={slots_text!r}"
    else:
        if chunk < 64 or chunk % 64 or not 1 <= slots <= 6:
            section["settings_error"] = f"FERRODIST_SHM_CHUNK={chunk}, FERRODIST_SHM_SLOTS={slots}"
    section.update(chunk=chunk, slots=slots, arena_bytes=nprocs * (SHM_COUNTER_BYTES + slots * chunk))
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError as exc:
        section.update(size_bytes=None, free_bytes=None, writable=False, missing=exc.strerror)
    else:
        section.update(
            size_bytes=stat.f_blocks * stat.f_frsize,
            free_bytes=stat.f_bavail * stat.f_frsize,
            writable=_can_create_file(SHM_DIR),
            missing=None,
        )
    wanted = env.get("FERRODIST_SHM_MEMFD", "1") != "0"
    section["memfd"] = _memfd_works()
    section["memfd_disabled"] = not wanted
    section["arena_in"] = "memfd" if wanted and section["memfd"] is True else SHM_DIR
    room = section["arena_in"] == "memfd" or (section["writable"] and section["free_bytes"] >= section["arena_bytes"])
    section["works"] = bool(room) and section["settings_error"] is None
    return section


def _can_create_file(directory: str) -> bool:
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix="ferrodist-doctor-"):
            return True
    except OSError:
        return False


def _memfd_works() -> bool | str:
    """True, or why an anonymous shared-memory file cannot be made here."""
    if not hasattr(os, "memfd_create"):
        return "this Python or system has no memfd_create"
    try:
        os.close(os.memfd_create("ferrodist-doctor", os.MFD_CLOEXEC))
    except OSError as exc:
        return f"memfd_create failed: {exc.strerror}"
    return True


def _ipv6_addresses() -> dict[str, list[str]]:
    """Interface name -> its IPv6 addresses (Linux: /proc/net/if_inet6)."""
    found: dict[str, list[str]] = {}
    try:
        with open("/proc/net/if_inet6") as table:
            rows = [line.split() for line in table]
    except OSError:
        return found
    for row in rows:
        if len(row) == 6:
            packed = bytes.fromhex(row[0])
            found.setdefault(row[5], []).append(socket.inet_ntop(socket.AF_INET6, packed))
    return found


def _default_route() -> str | None:
    """The interface of the IPv4 default route (Linux: /proc/net/route)."""
    try:
        with open("/proc/net/route") as table:
            rows = [line.split() for line in table][1:]
    except OSError:
        return None
    return next((row[0] for row in rows if len(row) > 2 and row[1] == "00000000"), None)


def _state(name: str) -> str | None:
    try:
        with open(f"/sys/class/net/{name}/operstate") as state:
            return state.read().strip()
    except OSError:
        return None


def network_section(master_addr: str | None) -> Section:
    """The interfaces, and the address a rank would give its peers (ferrodist.collectives'
    ``local_address``: the interface FERRODIST_SOCKET_IFNAME names, else loopback for a
    master on loopback, else the interface that routes to the master)."""
    from ferrodist.collectives import interface_address, local_address

    interfaces = []
    ipv6 = _ipv6_addresses()
    for _, name in socket.if_nameindex():
        try:
            ipv4: str | None = interface_address(name)
        except ValueError:  # InvalidArgument: no IPv4 address on it
            ipv4 = None
        interfaces.append({"name": name, "ipv4": ipv4, "ipv6": ipv6.get(name, []), "state": _state(name)})
    section: Section = {
        "interfaces": interfaces,
        "ifname": os.environ.get("FERRODIST_SOCKET_IFNAME") or None,
        "ifname_error": None,
        "default_route": _default_route(),
        "master_addr": master_addr,
        "master_error": None,
        "single_host_address": None,
        "address": None,
    }
    try:
        section["single_host_address"] = local_address("127.0.0.1")
    except ValueError as exc:  # InvalidArgument: FERRODIST_SOCKET_IFNAME names no usable interface
        section["ifname_error"] = str(exc)
        return section
    if master_addr:
        try:
            socket.getaddrinfo(master_addr, None)
            section["address"] = local_address(master_addr)
        except OSError as exc:
            section["master_error"] = f"{exc.strerror or exc}"
    else:
        route = next((i for i in interfaces if i["name"] == section["default_route"]), None)
        section["address"] = route["ipv4"] if route else None
    return section


def token_section() -> Section:
    """Whether FERRODIST_TOKEN is set (never its value)."""
    return {"set": bool(os.environ.get("FERRODIST_TOKEN"))}


def torch_section() -> Section:
    return {
        "version": version_of("torch"),
        "ferrodist_torch": installed("ferrodist.torch"),
        "ferrodist_torch_version": version_of("ferrodist-torch"),
    }


def auto_section(nprocs: int) -> Section:
    """What ``init_process_group("auto")`` picks in this process and in jobs started here."""
    from ferrodist.collectives import auto_backend

    has_mpi4py = installed("mpi4py")
    n = str(max(nprocs, 2))
    master = {"MASTER_ADDR": os.environ["MASTER_ADDR"]} if os.environ.get("MASTER_ADDR") else {}
    jobs = {
        "this process": dict(os.environ),
        f"ferrodist run -n {n}": {
            **{"RANK": "0", "WORLD_SIZE": n, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": n},
            **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        },
        f"mpiexec -n {n}": {
            **{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": n},
            **{"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": n},
            **master,
        },
        f"torchrun on 2 hosts of {n}": {
            **{"RANK": "0", "WORLD_SIZE": str(2 * int(n)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": n},
            **{"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
        },
    }
    picks: Section = {}
    for job, env in jobs.items():
        try:
            backend, why, info = auto_backend(env)
        except ValueError as exc:  # InvalidArgument: some of a launcher's variables, or a bad value
            picks[job] = {"backend": None, "why": None, "error": str(exc)}
            continue
        missing = missing_master(env, info, backend) if job == "this process" else None
        if missing is not None:
            picks[job] = {"backend": None, "why": None, "error": missing}
        else:
            picks[job] = {"backend": backend, "why": why, "error": None}
    return {"mpi4py": has_mpi4py, "picks": picks}


def missing_master(env: dict[str, str], info: Any, backend: str) -> str | None:
    """Why ``init_process_group("auto")`` cannot start (without ``rank=``, ``world_size=``
    or ``init_method=``) in a process with ``env``, whose ``launch_info`` is ``info`` and
    whose pick is ``backend``, when the master is what is missing; else ``None``."""
    if info is None:
        master = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name in env]
        if not master:
            return None
        shown = " and ".join(f"{name}={env[name]!r}" for name in master)
        return (
            f"RANK and WORLD_SIZE are not set but {shown} {'is' if len(master) == 1 else 'are'}: "
            "init_process_group() fails unless the script passes rank= and world_size=; start the ranks with "
            "`ferrodist run -n N script.py` (or torchrun), set RANK (this process's rank) and WORLD_SIZE (the "
            f"number of ranks) on every rank, or unset {' and '.join(master)} to run this process alone"
        )
    if backend not in ("tcp", "shm", "levels"):
        return None
    missing = [
        name for name, value in (("MASTER_ADDR", info.master_addr), ("MASTER_PORT", info.master_port)) if not value
    ]
    if not missing:
        return None
    if info.under_mpi:
        return (
            f"rank {info.rank} of {info.world_size} was started by mpiexec without mpi4py and without "
            f"{' and '.join(missing)}: install mpi4py (pip install -e './packages/transport[mpi]' from a clone of ferrodist) for the mpi backend, "
            "or pass the address to every rank: mpiexec -x MASTER_ADDR=HOST -x MASTER_PORT=PORT ..."
        )
    names, verb = " and ".join(missing), "is" if len(missing) == 1 else "are"
    if info.source == "slurm":
        return (
            f"{names} {verb} not set and SLURM's variables do not give {'it' if len(missing) == 1 else 'them'} "
            f"(task {info.rank} of {info.world_size}): set {names} on every task, or start the tasks with srun, "
            "which sets SLURM_STEP_NODELIST and SLURM_JOB_ID"
        )
    meaning = {"MASTER_ADDR": "the host of rank 0", "MASTER_PORT": "a free port there"}
    return (
        f"{names} {verb} not set but RANK and WORLD_SIZE are (rank {info.rank} of {info.world_size}): the ranks "
        "have no master to meet at (unless the script passes init_method='tcp://HOST:PORT'); start the ranks with "
        "`ferrodist run -n N script.py` (or torchrun), which sets all four; or set "
        f"{' and '.join(f'{n} ({meaning[n]})' for n in missing)} on every rank; or unset RANK and WORLD_SIZE to "
        "run this process alone"
    )
