"""An empty Numba cache breaks no deadline and no result.

A collective's first call for a (dtype, op) once compiled its shared-memory loop inside the
call, after its deadline had started: 2.7-16 s on 2 cores, so with a 4 s timeout one rank
returned while its peer raised, or both raised or returned late. Now a first call runs an
interpreted path while the loop compiles in the background; the interpreted and compiled
paths follow one protocol, so ranks on either get the same bits.

- first-use calls on an empty cache (bench/core/cold_start.py, a job per case): every rank
  returns the right result within a 4 s timeout, on each shm route;
- a whole property run over shm in which some ranks run only the interpreted paths and
  the others the compiled ones, across many chunks and reused slots.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPTS = Path(__file__).parent / "scripts"

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm (Linux)")

#: One case per route of the shared-memory collectives, each a (dtype, op) the others do not
#: compile: the one-slot all_reduce, the chunked all_reduce, the pairwise reduce_scatter.
CASES = "int8:product:small,float16:max:chunked,uint8:sum:reduce_scatter"


def test_first_use_calls_on_an_empty_cache_return_the_right_result_within_the_timeout(tmp_path):
    out = tmp_path / "cases.json"
    command = [sys.executable, str(ROOT / "bench" / "core" / "cold_start.py"), "--skip-job", "--cases", CASES]
    done = subprocess.run([*command, "--timeout", "4", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert out.exists(), done.stdout + done.stderr
    report = json.loads(out.read_text())
    for case in report["cases"]:
        ranks = case["ranks"]
        assert len(ranks) == 2, case
        for rank in ranks:
            assert rank["error"] is None, (case["case"], rank)
            assert rank["right"], (case["case"], rank)
            assert rank["seconds"] <= 4.0, (case["case"], rank)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("backend", "ranks"), [("shm", 3), ("tcp", 3), ("shm", 2)])
def test_ranks_on_the_interpreted_paths_and_ranks_on_the_compiled_loops_agree(monkeypatch, backend, ranks):
    """3 ranks (and 2 over shm, whose loops have a pass of their own for two), rank 1 interpreted: every ``Twin`` of the transport (the shared-memory loops
    and their stepwise protocol; the compiled frame calls and their Python steps) meets its
    other half in one call, and every result and every rank's bits must be the same. Over
    shm, 256-byte slots (3 of them): many cases cross many chunks and reuse slots, on every
    route."""
    monkeypatch.setenv("FERRODIST_SHM_CHUNK", "256")
    monkeypatch.setenv("FERRODIST_SHM_SLOTS", "3")
    cases = 400  # the 397 planned (every collective, dtype and op), then random ones
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferrodist.launch",
            "run",
            "-n",
            str(ranks),
            str(SCRIPTS / "mixed_kernels.py"),
            "1",
            str(cases),
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(ranks):
        assert f"[rank {rank}] rank {rank} of {ranks}: {cases} cases passed over {backend}" in done.stdout
