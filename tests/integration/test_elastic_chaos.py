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
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from chaos import run_seeds
from elastic_chaos import make_schedule, run_schedule

SCHEDULES = int(os.environ.get("FERRODIST_ELASTIC_SCHEDULES", "12"))
FIRST_SEED = int(os.environ.get("FERRODIST_CHAOS_SEED", "0"))


@pytest.mark.timeout(max(600, 100 * SCHEDULES))
def test_elastic_runs_agree_and_never_give_a_wrong_value(tmp_path):
    seeds = range(FIRST_SEED, FIRST_SEED + SCHEDULES)
    violations = run_seeds("elastic chaos", seeds, make_schedule, run_schedule, _kind, tmp_path)
    assert not violations, "\n".join(violations)


def _kind(schedule: dict) -> str:
    return f"{schedule['kind']}/{schedule['backend']}/{schedule['launch']}/{schedule['ranks']} ranks"
