"""The probes ``ferrodist doctor`` runs in child processes, killed at their deadline.

Loading an MPI library, initialising the CUDA driver or loading NCCL can block (a driver
waiting on a device, an MPI library contacting a daemon) and cannot be interrupted from a
thread, so each runs in a child Python that prints one JSON object. The children import
only what is installed: ``ferrodist.nccl`` is not a dependency of ferrodist-launch, and the
NCCL child reports it missing when it is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

#: mpi4py's version and the MPI library it loads, without MPI_Init (MPI_Get_library_version
#: may be called before it).
MPI_PROGRAM = """
import importlib.metadata as md, json
out = {"mpi4py": None, "library": None, "standard": None, "why": None}
try:
    out["mpi4py"] = md.version("mpi4py")
except md.PackageNotFoundError:
    pass
else:
    try:
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        out["library"] = " ".join(MPI.Get_library_version().split())
        out["standard"] = "%d.%d" % MPI.Get_version()
    except Exception as exc:
        out["why"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

#: The CUDA driver's version and GPUs through libcuda itself (no context is created, so no
#: GPU memory is taken), then whether cuda-python's and numba-cuda's modules import.
GPU_PROGRAM = """
import ctypes, importlib, json
out = {"driver": None, "gpus": [], "why": None, "imports": {}}
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    out["why"] = f"no NVIDIA driver ({exc})"
else:
    c_int, byref = ctypes.c_int, ctypes.byref
    cuda.cuDeviceGetName.argtypes = [ctypes.c_char_p, c_int, c_int]
    cuda.cuDeviceTotalMem_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), c_int]
    version = c_int(0)
    if cuda.cuDriverGetVersion(byref(version)) == 0:
        out["driver"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    status = cuda.cuInit(0)
    if status == 100:
        out["why"] = "the NVIDIA driver sees no GPU (CUDA_ERROR_NO_DEVICE)"
    elif status != 0:
        out["why"] = f"cuInit failed with CUDA error {status}"
    else:
        count = c_int(0)
        cuda.cuDeviceGetCount(byref(count))
        for index in range(count.value):
            device, name, memory = c_int(0), ctypes.create_string_buffer(256), ctypes.c_size_t(0)
            major, minor = c_int(0), c_int(0)
            cuda.cuDeviceGet(byref(device), index)
            cuda.cuDeviceGetName(name, 256, device.value)
            cuda.cuDeviceTotalMem_v2(byref(memory), device.value)
            cuda.cuDeviceGetAttribute(byref(major), 75, device.value)  # compute capability
            cuda.cuDeviceGetAttribute(byref(minor), 76, device.value)
            out["gpus"].append({
                "index": index, "name": name.value.decode(errors="replace"),
                "memory_bytes": memory.value, "compute_capability": f"{major.value}.{minor.value}",
            })
        if not out["gpus"]:
            out["why"] = "the NVIDIA driver lists no GPU"
for key, module in (("cuda-python", "cuda.bindings.driver"), ("numba-cuda", "numba.cuda")):
    try:
        importlib.import_module(module)
        out["imports"][key] = None
    except Exception as exc:
        out["imports"][key] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

#: The NCCL library through ferrodist.nccl's public API, when ferrodist-nccl is installed.
NCCL_PROGRAM = """
import importlib.util, json
out = {"installed": False, "available": False, "path": None, "version": None, "why": None}
try:
    out["installed"] = importlib.util.find_spec("ferrodist.nccl") is not None
except ImportError:
    pass
if out["installed"]:
    from ferrodist.nccl import library_path, nccl_version
    try:
        out["path"] = library_path()
        out["version"] = ".".join(str(part) for part in nccl_version())
        out["available"] = True
    except Exception as exc:
        out["why"] = str(exc)
else:
    out["why"] = "ferrodist-nccl is not installed"
print(json.dumps(out))
"""


def child_section(program: str, timeout: float) -> dict[str, Any]:
    """Run ``program`` in a child of this Python; its last line of output, as JSON.

    Raises:
        RuntimeError: the child did not finish within ``timeout`` seconds (it is killed),
            failed, or printed no JSON.
    """
    try:
        done = subprocess.run(
            [sys.executable, "-c", program],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the probe did not finish within {timeout:g} s (killed)") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        errors = done.stderr.strip().splitlines()
        raise RuntimeError(errors[-1] if errors else f"the probe exited with status {done.returncode}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def mpiexec_section(timeout: float) -> dict[str, Any]:
    """The ``mpiexec`` on PATH and the first line of its ``--version``."""
    path = shutil.which("mpiexec")
    if path is None:
        return {"path": None, "version": None}
    try:
        done = subprocess.run(
            [path, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{path} --version did not finish within {timeout:g} s (killed)") from None
    except OSError as exc:
        raise RuntimeError(f"cannot run {path}: {exc.strerror}") from None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return {"path": path, "version": lines[0] if lines else None}
