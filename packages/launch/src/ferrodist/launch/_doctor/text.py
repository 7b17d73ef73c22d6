"""``ferrodist doctor``'s report as text: one labelled line (or a few) per section."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Section = dict[str, Any]


def size_text(nbytes: int | None) -> str:
    """``nbytes`` in GiB, MiB or KiB (one decimal)."""
    if nbytes is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _python(s: Section) -> str:
    return f"{s['version']} ({s['implementation']}, {s['executable']}) on {s['platform']}"


def _numba(s: Section) -> str:
    if s["cache_dir"] is None:
        cache = "no writable kernel cache"
    else:
        cache = f"kernel cache {s['cache_dir']} ({s['cache_where']}, {'writable' if s['cache_writable'] else 'NOT writable'})"
    return f"{s['version']} (llvmlite {s['llvmlite']}); {cache}"


def _kernels(s: Section) -> str:
    held = f"all {s['total']}" if s["cached"] == s["total"] else f"{s['cached']} of the {s['total']}"
    todo = "" if s["cached"] == s["total"] else "; run `ferrodist warm`"
    return f"{held} kernels `ferrodist warm` compiles are cached ({', '.join(s['dtypes'])}; {s['ranks']} ranks a host){todo}"


def _cpu(s: Section) -> str:
    bits = s["kernel_vector_bits"]
    if bits is None:
        width = f"vector width not read (machine code of {s['machine']} is not inspected)"
    elif bits == 0:
        width = "the float32 sum kernel compiles to a SCALAR loop"
    else:
        width = f"the float32 sum kernel uses {bits}-bit vectors ({ {128: 'xmm', 256: 'ymm', 512: 'zmm'}[bits] })"
    target = f", compiling for {s['target']} (NUMBA_CPU_NAME)" if s["target"] else ""
    level = s["simd"] or "no SIMD"
    return f"{s['machine']}, {s['cores']} cores, {s['name']}{target}: {level} ({' '.join(s['simd_features'])}); {width}"


def _shm(s: Section) -> str:
    if s["missing"]:
        space = f"missing ({s['missing']})"
    else:
        space = f"{size_text(s['size_bytes'])}, {size_text(s['free_bytes'])} free, {'writable' if s['writable'] else 'NOT writable'}"
    if s["arena_in"] == "memfd":
        where = "a memfd (not limited by /dev/shm's size)"
    else:
        why = "FERRODIST_SHM_MEMFD=0" if s["memfd_disabled"] else s["memfd"]
        where = f"{s['directory']} ({why})"
    return f"{space}; a job of {s['ranks']} ranks puts its {size_text(s['arena_bytes'])} arena in {where}"


def _mpi(s: Section) -> str:
    if not s["mpi4py"]:
        return "mpi4py not installed"
    library = (s["library"] or "").split(",")[0] or f"no MPI library ({s['why']})"
    standard = f" (MPI {s['standard']})" if s["standard"] else ""
    return f"mpi4py {s['mpi4py']}, {library}{standard}"


def _mpiexec(s: Section) -> str:
    return f"{s['path']} ({s['version']})" if s["path"] else "not on PATH"


def _gpu(s: Section) -> list[str]:
    imports = ", ".join(
        f"{name} {'imports' if why is None else f'does not import ({why})'}" for name, why in s["imports"].items()
    )
    driver = f"driver {s['driver']}" if s["driver"] else "no driver"
    lines = [f"{driver}; {imports}"]
    for gpu in s["gpus"]:
        lines.append(
            f"GPU {gpu['index']}: {gpu['name']}, {size_text(gpu['memory_bytes'])}, sm_{gpu['compute_capability']}"
        )
    if not s["gpus"]:
        lines.append(f"no GPU: {s['why']}")
    return lines


def _nccl(s: Section) -> str:
    if s["available"]:
        return f"{s['version']} ({s['path']})"
    return f"not available: {s['why']}"


def _torch(s: Section) -> str:
    torch = f"torch {s['version']}" if s["version"] else "torch not installed"
    mine = "ferrodist.torch installed" if s["ferrodist_torch"] else "ferrodist.torch not installed"
    return f"{torch}; {mine}"


def _network(s: Section) -> list[str]:
    lines = []
    for i in s["interfaces"]:
        addresses = " ".join(a for a in [i["ipv4"], *i["ipv6"]] if a) or "no address"
        lines.append(f"{i['name']}: {addresses} ({i['state'] or 'state unknown'})")
    if s["ifname_error"]:
        lines.append(f"address: {s['ifname_error']}")
        return lines
    if s["ifname"]:
        lines.append(f"address: FERRODIST_SOCKET_IFNAME={s['ifname']}: every rank uses {s['single_host_address']}")
        return lines
    lines.append(f"address: single-host jobs use {s['single_host_address']}")
    if s["master_addr"]:
        reach = s["address"] or f"nothing ({s['master_error']})"
        lines.append(f"address: a multi-host job with master {s['master_addr']} uses {reach}")
    else:
        lines.append(
            f"address: a multi-host job uses the interface that routes to MASTER_ADDR (the default route: "
            f"{s['default_route'] or 'none'}, {s['address'] or 'no IPv4 address'}); set FERRODIST_SOCKET_IFNAME to choose"
        )
    return lines


def _token(s: Section) -> str:
    if s["set"]:
        return "FERRODIST_TOKEN is set: ranks must hold the same token to join"
    return (
        "FERRODIST_TOKEN not set here (ferrodist run makes one per job; ranks started another way without one "
        "may admit any process that reaches their store)"
    )


def _auto(s: Section) -> list[str]:
    return [
        f"{job}: {pick['backend']} ({pick['why']})"
        if pick["backend"]
        else f"{job}: cannot start (see the problem below)"
        for job, pick in s["picks"].items()
    ]


_RENDER: dict[str, tuple[str, Callable[[Section], str | list[str]]]] = {
    "python": ("python", _python),
    "numpy": ("numpy", lambda s: str(s["version"])),
    "numba": ("numba", _numba),
    "kernels": ("kernels", _kernels),
    "cpu": ("cpu", _cpu),
    "shm": ("/dev/shm", _shm),
    "mpi": ("mpi", _mpi),
    "mpiexec": ("mpiexec", _mpiexec),
    "gpu": ("cuda", _gpu),
    "nccl": ("nccl", _nccl),
    "torch": ("torch", _torch),
    "network": ("network", _network),
    "token": ("token", _token),
    "auto": ("auto", _auto),
}


def available(report: dict[str, Section]) -> dict[str, bool]:
    """Which backends can start here (nccl: its library loads and there is a GPU)."""
    network, shm, mpi, gpu, nccl = (report.get(k, {}) for k in ("network", "shm", "mpi", "gpu", "nccl"))
    tcp = "failed" not in network and not network.get("ifname_error")
    return {
        "tcp": tcp,
        "shm": tcp and bool(shm.get("works")),
        "mpi": bool(mpi.get("library")),
        "nccl": bool(nccl.get("available")) and bool(gpu.get("gpus")),
    }


def _backends(report: dict[str, Section]) -> str:
    ready = available(report)
    shm, mpi, nccl = (report.get(k, {}) for k in ("shm", "mpi", "nccl"))
    parts = [f"tcp {'yes' if ready['tcp'] else 'NO'}", f"shm yes ({shm['arena_in']})" if ready["shm"] else "shm NO"]
    parts.append(f"mpi yes ({mpi['library'].split(',')[0]})" if ready["mpi"] else "mpi no")
    if ready["nccl"]:
        parts.append(f"nccl yes ({nccl['version']})")
    else:
        parts.append(f"nccl no (library {nccl['version']}, no GPU)" if nccl.get("available") else "nccl no")
    return ", ".join(parts)


def render(report: dict[str, Section], problems: list[str], notes: list[str]) -> str:
    """The report as aligned ``label  text`` lines, then the notes and the problems."""
    lines = []
    for name, (label, show) in _RENDER.items():
        section = report.get(name)
        if section is None:
            continue
        try:
            shown = [f"could not check: {section['failed']}"] if "failed" in section else show(section)
        except (KeyError, TypeError, ValueError) as exc:  # a section shaped unlike this renderer expects
            shown = [f"could not show ({type(exc).__name__}: {exc})"]
        for i, text in enumerate([shown] if isinstance(shown, str) else shown):
            lines.append(f"{label if i == 0 else '':<9} {text}")
    lines.append(f"{'backends':<9} {_backends(report)}")
    lines += [f"note      {note}" for note in notes]
    lines += [f"PROBLEM   {problem}" for problem in problems] or ["problems  none"]
    return "\n".join(lines)
