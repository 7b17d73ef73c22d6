"""The chaos suite: random collectives under random faults in real processes, every
result and every error checked (see chaos.py for the schedules and the invariant).

CI runs ``FERRODIST_CHAOS_SCHEDULES`` schedules (default 24) from seed
``FERRODIST_CHAOS_SEED`` (default 0); ``make chaos`` runs 500.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from chaos import make_schedule, run_schedule

SCHEDULES = int(os.environ.get("FERRODIST_CHAOS_SCHEDULES", "24"))
FIRST_SEED = int(os.environ.get("FERRODIST_CHAOS_SEED", "0"))


@pytest.mark.timeout(max(600, 120 * SCHEDULES))
def test_random_faults_never_give_a_wrong_result_or_a_late_error(tmp_path):
    started = time.monotonic()
    violations: list[str] = []
    kinds: dict[str, int] = {}
    for seed in range(FIRST_SEED, FIRST_SEED + SCHEDULES):
        schedule = make_schedule(seed)
        key = f"{schedule['fault']['kind']}/{schedule['backend']}/{schedule['launch']}"
        key += "/cold" if schedule["cold"] else ""
        key += "/nodes" if schedule.get("nodes") else ""
        kinds[key] = kinds.get(key, 0) + 1
        violations += run_schedule(schedule, tmp_path / f"s{seed}")
    took = time.monotonic() - started
    print(
        f"\nchaos: {SCHEDULES} schedules (seeds {FIRST_SEED}..{FIRST_SEED + SCHEDULES - 1}) in {took:.0f} s, "
        f"{len(violations)} violations; by fault/backend/launch: {dict(sorted(kinds.items()))}"
    )
    assert not violations, "\n".join(violations)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["stranger", "duplicate", "cold"])
def test_processes_outside_the_job_a_second_rank_or_a_cold_cache(tmp_path, kind):
    """Schedules with the fault ``kind`` in each backend, however the random draw goes: a
    stranger's connections to every port during the start (the job starts and every call
    returns), a second process with one of the ranks (every process stops, saying so), or
    a kill in the middle of the calls on an empty Numba cache (kernels compiling in the
    background while the calls run and fail)."""
    violations: list[str] = []
    for seed, backend in ((FIRST_SEED + 1000, "tcp"), (FIRST_SEED + 1001, "shm")):
        schedule = make_schedule(seed)
        schedule["backend"] = backend
        if kind == "cold":
            schedule["cold"] = True
            schedule["fault"].update(kind="kill", at=len(schedule["calls"]) // 2)
        else:
            schedule["fault"]["kind"] = kind
            schedule["launch"] = "hand" if kind == "duplicate" else schedule["launch"]
        violations += run_schedule(schedule, tmp_path / f"s{seed}")
    assert not violations, "\n".join(violations)
