"""Shared test configuration: hypothesis profiles.

Profiles (pick with FERRODIST_HYPOTHESIS_PROFILE, default "ci"):
- ci:  derandomized (the same examples on every run), no deadline, the example counts
       stated in each test module;
- dev: random examples, five times as many, for hunting bugs locally.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("FERRODIST_HYPOTHESIS_PROFILE", "ci"))
