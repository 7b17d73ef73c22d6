"""Elastic chaos: random trainings under ``ferrodist.elastic.run`` with kills, stops, slow
ranks and exceptions during the steps and during the recoveries, every step's value and
every survivor's final state checked (see elastic_chaos.py for the schedules and the
invariant).

CI runs ``FERRODIST_ELASTIC_SCHEDULES`` schedules (default 12) from seed
``FERRODIST_CHAOS_SEED`` (default 0); ``make chaos`` runs 500.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from chaos import hog_from_environment
from elastic_chaos import make_schedule, run_schedule

SCHEDULES = int(os.environ.get("FERRODIST_ELASTIC_SCHEDULES", "12"))
FIRST_SEED = int(os.environ.get("FERRODIST_CHAOS_SEED", "0"))


@pytest.mark.timeout(max(600, 100 * SCHEDULES))
def test_elastic_runs_agree_and_never_give_a_wrong_value(tmp_path):
    started = time.monotonic()
    violations: list[str] = []
    kinds: dict[str, int] = {}
    loads: list[float] = []
    with hog_from_environment() as hog:
        for seed in range(FIRST_SEED, FIRST_SEED + SCHEDULES):
            schedule = make_schedule(seed)
            key = f"{schedule['kind']}/{schedule['backend']}/{schedule['launch']}"
            kinds[key] = kinds.get(key, 0) + 1
            found = run_schedule(schedule, tmp_path / f"s{seed}")
            loads.append(schedule["load"])
            print(
                f"seed {seed} {key} ({schedule['ranks']} ranks): load {schedule['load']:.1f}, {len(found)} violations",
                flush=True,
            )
            violations += found
    took = time.monotonic() - started
    print(
        f"\nelastic chaos: {SCHEDULES} schedules (seeds {FIRST_SEED}..{FIRST_SEED + SCHEDULES - 1}) in {took:.0f} s "
        f"beside {hog.count} busy processes, load {min(loads):.1f}..{max(loads):.1f}, {len(violations)} violations; "
        f"by fault/backend/launch: {dict(sorted(kinds.items()))}"
    )
    assert not violations, "\n".join(violations)
