"""Shared test configuration: hypothesis profiles.

Profiles (pick with FERRODIST_HYPOTHESIS_PROFILE, default "ci"):
- ci:  derandomized (the same examples on every run), no deadline, the example counts
       stated in each test module;
- dev: random examples, five times as many, for hunting bugs locally.

GPU tests run under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set here unless the
environment already says otherwise; run with ``NUMBA_ENABLE_CUDASIM=0`` on a machine with a
GPU). Tests that need real hardware are marked ``gpu`` and skip without one.
"""

from __future__ import annotations

import os

# GPU code runs on Numba's CUDA simulator unless the caller chose otherwise (numba reads
# this when it is first imported, so it must be set before any test imports ferrodist).
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

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
