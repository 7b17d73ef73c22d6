"""`ferrodist doctor`: the report matches this machine, and each simulated problem gives its line.

Most tests run the command in this process (``main(["doctor", ...])``) so that a probe's
inputs can be monkeypatched; two run it as a real command. The GPU listing is checked
against a stand-in ``libcuda.so.1`` compiled here (this machine has no GPU).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import numba
import numpy
import pytest

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")
from ferrodist.collectives import auto_backend
from ferrodist.launch import main
from ferrodist.launch._doctor import children, probes

TOP_LEVEL = {
    "ok",
    "problems",
    "notes",
    "required",
    "backends",
    "python",
    "numpy",
    "numba",
    "kernels",
    "cpu",
    "shm",
    "network",
    "token",
    "torch",
    "auto",
    "mpi",
    "mpiexec",
    "gpu",
    "nccl",
}


def doctor(capsys, *args: str) -> tuple[int, dict]:
    """Run ``ferrodist doctor --json ARGS`` here; its exit status and its JSON."""
    capsys.readouterr()
    code = main(["doctor", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def doctor_text(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def command(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


#: The launcher variables ferrodist reads besides RANK, WORLD_SIZE and MASTER_ADDR.
LAUNCHER_VARIABLES = (
    "MASTER_PORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No variable of the ones the doctor judges, whatever the calling shell exported."""
    for name in (
        "FERRODIST_SOCKET_IFNAME",
        "FERRODIST_SHM_MEMFD",
        "FERRODIST_SHM_CHUNK",
        "FERRODIST_SHM_SLOTS",
        "MASTER_ADDR",
        "RANK",
        "WORLD_SIZE",
        *LAUNCHER_VARIABLES,
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_command_exits_0_here_and_prints_every_section():
    env = {k: v for k, v in os.environ.items() if k not in ("FERRODIST_SOCKET_IFNAME", "MASTER_ADDR")}
    done = command(env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    labels = {line.split()[0] for line in done.stdout.splitlines() if line and not line.startswith(" ")}
    assert {"python", "numpy", "numba", "cpu", "/dev/shm", "mpi", "cuda", "nccl", "torch", "network"} <= labels
    assert {"token", "auto", "backends"} <= labels
    assert done.stdout.rstrip().endswith("problems  none")


def test_the_command_reads_the_variables_it_judges(tmp_path):
    """As a real command: NUMBA_CACHE_DIR under a file and an interface that does not exist."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(blocker / "cache"), FERRODIST_SOCKET_IFNAME="nosuch0")
    env.pop("MASTER_ADDR", None)
    done = command(env=env)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr
    problems = [line for line in done.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"PROBLEM   NUMBA_CACHE_DIR={blocker / 'cache'} is not a writable directory")
    assert problems[1].startswith("PROBLEM   FERRODIST_SOCKET_IFNAME='nosuch0': no IPv4 address on that interface")


def test_the_json_holds_this_machine(capsys, clean_env):
    code, doc = doctor(capsys)
    assert code == 0 and doc["ok"] is True and doc["problems"] == [], doc["problems"]
    assert set(doc) == TOP_LEVEL
    assert doc["python"]["version_info"] == list(sys.version_info[:3])
    assert doc["python"]["executable"] == sys.executable
    assert doc["numpy"]["version"] == numpy.__version__
    assert doc["numba"]["version"] == numba.__version__
    assert doc["numba"]["cache_writable"] is True and os.path.isdir(doc["numba"]["cache_dir"])
    assert doc["cpu"]["cores"] == os.cpu_count()
    stat = os.statvfs("/dev/shm")
    assert doc["shm"]["size_bytes"] == stat.f_blocks * stat.f_frsize
    assert doc["shm"]["ranks"] == os.cpu_count()
    assert doc["shm"]["arena_bytes"] == os.cpu_count() * (8 * 64 + 2 * (1 << 20))
    names = [i["name"] for i in doc["network"]["interfaces"]]
    assert names == [name for _, name in socket.if_nameindex()]
    assert next(i for i in doc["network"]["interfaces"] if i["name"] == "lo")["ipv4"] == "127.0.0.1"
    assert doc["network"]["single_host_address"] == "127.0.0.1"
    assert doc["token"]["set"] == bool(os.environ.get("FERRODIST_TOKEN"))
    assert doc["torch"]["version"] == importlib.metadata.version("torch")
    assert doc["mpi"]["mpi4py"] == importlib.metadata.version("mpi4py")
    assert doc["mpi"]["library"], doc["mpi"]
    assert doc["mpiexec"]["path"] == shutil.which("mpiexec")
    picks = {job.split(" -n")[0]: pick["backend"] for job, pick in doc["auto"]["picks"].items()}
    assert picks["this process"] == "simulated"
    assert picks["ferrodist run"] == "shm" and picks["mpiexec"] == "mpi"
    assert doc["backends"]["tcp"] is True and doc["backends"]["shm"] is True and doc["backends"]["mpi"] is True


def test_the_cpu_section_agrees_with_llvm_and_the_machine_code(capsys, clean_env):
    from llvmlite import binding

    _, doc = doctor(capsys)
    cpu = doc["cpu"]
    features = binding.get_host_cpu_features()
    assert cpu["name"] == binding.get_host_cpu_name()
    assert all(features.get(level) for level in cpu["simd_features"])
    if cpu["machine"] in ("x86_64", "AMD64"):
        widest = 512 if features.get("avx512f") else 256 if features.get("avx") else 128
        assert cpu["simd"] == next(lv for lv in probes._X86_LEVELS if features.get(lv))
        assert 128 <= cpu["kernel_vector_bits"] <= widest
        assert cpu["kernel_vector_bits"] >= 256 or not features.get("avx2")


def test_nccl_as_ferrodist_nccl_sees_it(capsys, clean_env):
    nccl = pytest.importorskip("ferrodist.nccl")
    _, doc = doctor(capsys)
    if nccl.is_available():
        assert doc["nccl"]["version"] == ".".join(str(p) for p in nccl.nccl_version())
        assert doc["nccl"]["path"] == nccl.library_path()
    else:
        assert doc["nccl"]["available"] is False and doc["nccl"]["why"]


def test_a_full_dev_shm_without_memfd_is_a_problem_with_what_to_do(capsys, clean_env):
    clean_env.setenv("FERRODIST_SHM_MEMFD", "0")
    real = os.statvfs

    def small(path):
        if path != probes.SHM_DIR:
            return real(path)
        return SimpleNamespace(f_blocks=64, f_bavail=1, f_frsize=1 << 20)  # 64 MiB, 1 MiB free

    clean_env.setattr(os, "statvfs", small)
    code, doc = doctor(capsys, "-n", "8")
    assert code == 1 and doc["ok"] is False and doc["backends"]["shm"] is False
    (line,) = [p for p in doc["problems"] if p.startswith("/dev/shm")]
    assert "has 1.0 MiB free of 64.0 MiB (FERRODIST_SHM_MEMFD=0)" in line
    assert "needs 16.0 MiB there for a job of 8 ranks" in line
    assert "mount a larger tmpfs" in line and "backend='tcp'" in line
    assert any("/dev/shm is 64.0 MiB" in note for note in doc["notes"])


def test_without_memfd_the_arena_goes_to_dev_shm_and_the_line_says_why(capsys, clean_env):
    def no_memfd(name, flags=0):
        raise OSError(38, "Function not implemented")

    real = os.statvfs
    clean_env.setattr(os, "memfd_create", no_memfd)
    clean_env.setattr(
        os,
        "statvfs",
        lambda p: SimpleNamespace(f_blocks=4, f_bavail=2, f_frsize=1 << 20) if p == "/dev/shm" else real(p),
    )
    code, doc = doctor(capsys, "-n", "2")
    assert code == 1 and doc["shm"]["arena_in"] == "/dev/shm"
    assert any("memfd_create failed: Function not implemented" in p and "4.0 MiB" in p for p in doc["problems"])


def test_plenty_of_dev_shm_without_memfd_is_fine(capsys, clean_env):
    clean_env.setenv("FERRODIST_SHM_MEMFD", "0")
    code, doc = doctor(capsys, "-n", "2")
    assert code == 0 and doc["shm"]["arena_in"] == "/dev/shm" and doc["shm"]["works"] is True


def test_bad_shm_settings_are_a_problem(capsys, clean_env):
    clean_env.setenv("FERRODIST_SHM_CHUNK", "100")
    code, doc = doctor(capsys)
    assert code == 1
    assert any(
        p.startswith("FERRODIST_SHM_CHUNK=100, FERRODIST_SHM_SLOTS=2: the shm backend refuses") for p in doc["problems"]
    )


def test_an_unwritable_numba_cache_dir_is_a_problem(capsys, clean_env, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    clean_env.setattr(numba.config, "CACHE_DIR", str(blocker / "cache"))  # under a file: never a directory
    code, doc = doctor(capsys)
    assert code == 1 and doc["numba"]["cache_dir_requested_writable"] is False
    (line,) = [p for p in doc["problems"] if p.startswith("NUMBA_CACHE_DIR=")]
    assert str(blocker / "cache") in line and "is not a writable directory" in line and "unset it" in line


def test_no_writable_cache_anywhere_is_a_problem(capsys, clean_env):
    from numba.core import caching

    def nowhere(py_func):
        raise RuntimeError("cannot cache function 'kernel': no locator available for file")

    clean_env.setattr(caching, "FunctionCache", nowhere)
    code, doc = doctor(capsys)
    assert code == 1 and doc["numba"]["cache_writable"] is False
    assert any(
        "no writable directory for ferrodist's kernel cache" in p and "NUMBA_CACHE_DIR" in p for p in doc["problems"]
    )


def test_an_interface_that_does_not_exist_is_a_problem(capsys, clean_env):
    clean_env.setenv("FERRODIST_SOCKET_IFNAME", "nosuch0")
    code, text = doctor_text(capsys)
    assert code == 1
    (line,) = [line for line in text.splitlines() if line.startswith("PROBLEM") and "nosuch0" in line]
    assert "no IPv4 address on that interface" in line and "lo" in line and "or unset it" in line
    assert "tcp NO, shm NO" in text


def test_an_existing_interface_is_the_address(capsys, clean_env):
    clean_env.setenv("FERRODIST_SOCKET_IFNAME", "lo")
    code, doc = doctor(capsys, "--master-addr", "127.0.0.1")
    assert code == 0 and doc["network"]["address"] == "127.0.0.1" and doc["network"]["ifname"] == "lo"


def test_bad_launcher_variables_are_a_problem(capsys, clean_env):
    clean_env.setenv("RANK", "abc")
    clean_env.setenv("WORLD_SIZE", "2")
    code, doc = doctor(capsys)
    assert code == 1
    assert any(p.startswith("launcher variables of this process:") and "RANK='abc'" in p for p in doc["problems"])


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29800"},
            "WORLD_SIZE is not set but RANK='1', MASTER_ADDR='127.0.0.1' and MASTER_PORT='29800' are",
        ),
        ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR and MASTER_PORT are not set but WORLD_SIZE='2' is"),
        (
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29800"},
            "RANK and WORLD_SIZE are not set but MASTER_ADDR='127.0.0.1' and MASTER_PORT='29800' are",
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT are not set but RANK and WORLD_SIZE are"),
        ({"RANK": "abc"}, "environment variable RANK='abc' is not an integer"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_SIZE is not set but OMPI_COMM_WORLD_RANK='1' is"),
    ],
)
def test_a_partial_launcher_environment_is_a_problem_naming_what_is_missing(capsys, clean_env, env, said):
    """Not "a world of one, problems none": what init_process_group would refuse, with what to do."""
    for name, value in env.items():
        clean_env.setenv(name, value)
    code, doc = doctor(capsys)
    assert code == 1 and doc["ok"] is False
    found = [p for p in doc["problems"] if p.startswith("launcher variables of this process: ")]
    assert len(found) == 1 and said in found[0], doc["problems"]
    assert "start the ranks with" in found[0] or "set it to a number, or unset it" in found[0], found[0]
    assert doc["auto"]["picks"]["this process"]["backend"] is None
    code, text = doctor_text(capsys)
    assert code == 1 and "problems  none" not in text
    assert "this process: cannot start (see the problem below)" in text
    assert f"PROBLEM   {found[0]}" in text


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "0", "WORLD_SIZE": "1"},  # a world of one needs no master
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29800"},
        {"SLURM_PROCID": "0"},  # an sbatch script without --ntasks runs one process
        {"LOCAL_RANK": "1"},
    ],
)
def test_a_whole_launcher_environment_is_no_problem(capsys, clean_env, env):
    for name, value in env.items():
        clean_env.setenv(name, value)
    code, doc = doctor(capsys)
    assert code == 0 and doc["problems"] == [], doc["problems"]


def test_require_gpu_here_says_there_is_none():
    done = command("--require", "gpu")
    doc = json.loads(command("--json").stdout)
    if doc["gpu"].get("gpus"):
        pytest.skip("this machine has a GPU")
    assert done.returncode == 1
    assert any(line.startswith("PROBLEM   --require gpu: no GPU found") for line in done.stdout.splitlines())


def test_require_names_are_checked(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["doctor", "--require", "gpu,tpu"])
    assert stop.value.code == 2 and "unknown piece 'tpu'" in capsys.readouterr().err


def test_require_of_what_is_here_passes(capsys, clean_env):
    code, doc = doctor(capsys, "--require", "mpi")
    assert code == 0 and doc["required"] == ["mpi"]


def test_a_probe_that_raises_is_a_line_not_a_traceback(capsys, clean_env):
    def broken():
        raise RuntimeError("boom")

    clean_env.setattr(probes, "numpy_section", broken)
    code, text = doctor_text(capsys)
    assert code == 1 and "Traceback" not in text
    assert "numpy     could not check: RuntimeError: boom" in text
    assert "PROBLEM   numpy: the check failed (RuntimeError: boom); install numpy" in text


def test_a_probe_that_hangs_is_left_at_the_deadline(capsys, clean_env):
    release = threading.Event()

    def hangs():
        release.wait(120)
        return {}

    clean_env.setattr(probes, "torch_section", hangs)
    try:
        _, doc = doctor(capsys, "--timeout", "5")
    finally:
        release.set()
    assert doc["torch"] == {"failed": "the probe did not finish within 5 s"}
    assert "torch: the check failed (the probe did not finish within 5 s)" in doc["notes"]  # optional: a note


def test_a_child_that_hangs_is_killed_at_the_deadline(clean_env):
    with pytest.raises(RuntimeError, match=r"did not finish within 1 s \(killed\)"):
        children.child_section("import time; time.sleep(60)", 1.0)


def test_a_child_that_fails_gives_its_last_error_line():
    with pytest.raises(RuntimeError, match="ZeroDivisionError: division by zero"):
        children.child_section("1 / 0", 60.0)


@pytest.mark.parametrize(
    ("env", "backend"),
    [
        ({}, "simulated"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "shm"),
        ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "levels"),
        ({"RANK": "0", "WORLD_SIZE": "1"}, "simulated"),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "mpi"),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "MASTER_ADDR": "h",
            },
            "shm",
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "MASTER_ADDR": "h",
            },
            "levels",
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "3", "MPI_LOCALNRANKS": "3"}, "mpi"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "MASTER_ADDR": "h"}, "tcp"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NODEID": "1", "MASTER_ADDR": "h"}, "levels"),
    ],
)
def test_the_doctor_shows_init_process_groups_own_pick(env, backend):
    """The doctor asks ferrodist.collectives (``auto_backend``, the rule init_process_group
    follows) instead of keeping a copy of the rule; with mpi4py installed."""
    pytest.importorskip("mpi4py")
    chosen, why, info = auto_backend(env)
    assert chosen == backend and why
    assert (info is None) == (env == {})


FAKE_LIBCUDA = r"""
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
int cuInit(unsigned int flags) { return getenv("FAKE_CUDA_NO_DEVICE") ? 100 : 0; }
int cuDriverGetVersion(int *v) { *v = 12040; return 0; }
int cuDeviceGetCount(int *n) { *n = 2; return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDeviceGetName(char *name, int len, int d) { strncpy(name, d ? "Fake GPU B" : "Fake GPU A", len); return 0; }
int cuDeviceTotalMem_v2(size_t *b, int d) { *b = (size_t)(d + 1) << 34; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int d) { *v = attr == 75 ? 9 : 0; return 0; }
"""


@pytest.fixture
def fake_driver(tmp_path, monkeypatch):
    """A stand-in libcuda.so.1 with two GPUs, found first by the probe's child."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in libcuda.so.1")
    source = tmp_path / "cuda.c"
    source.write_text(FAKE_LIBCUDA)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(source)], check=True, timeout=60
    )
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    return monkeypatch


def test_the_gpus_the_driver_lists(capsys, clean_env, fake_driver):
    code, doc = doctor(capsys, "--require", "gpu")
    assert code == 0, doc["problems"]
    assert doc["gpu"]["driver"] == "12.4"
    assert doc["gpu"]["gpus"] == [
        {"index": 0, "name": "Fake GPU A", "memory_bytes": 16 << 30, "compute_capability": "9.0"},
        {"index": 1, "name": "Fake GPU B", "memory_bytes": 32 << 30, "compute_capability": "9.0"},
    ]
    _, text = doctor_text(capsys)
    assert "GPU 0: Fake GPU A, 16.0 GiB, sm_9.0" in text and "driver 12.4" in text


def test_a_driver_without_gpus(capsys, clean_env, fake_driver):
    fake_driver.setenv("FAKE_CUDA_NO_DEVICE", "1")
    code, doc = doctor(capsys, "--require", "gpu")
    assert code == 1 and doc["gpu"]["gpus"] == []
    assert any("--require gpu: no GPU found (the NVIDIA driver sees no GPU" in p for p in doc["problems"])


def test_an_empty_kernel_cache_is_a_note_that_says_to_warm(tmp_path):
    """The cache's index is read, not loaded: an empty NUMBA_CACHE_DIR holds none of what
    `ferrodist warm` compiles; the report says how many and what to run."""
    done = command("--json", env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    doc = json.loads(done.stdout)
    assert doc["kernels"]["cached"] == 0 and doc["kernels"]["total"] > 100
    (note,) = [n for n in doc["notes"] if "kernel cache" in n]
    assert f"0 of the {doc['kernels']['total']} kernels" in note and "run `ferrodist warm`" in note
