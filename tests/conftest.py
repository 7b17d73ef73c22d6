"""Shared test configuration: hypothesis profiles, and the ``checks_made`` fixture.

Profiles (pick with FERRODIST_HYPOTHESIS_PROFILE, default "ci"):
- ci:  derandomized (the same examples on every run), no deadline, the example counts
       stated in each test module;
- dev: random examples, five times as many, for hunting bugs locally.

A run of many tests starts ``tests/_warm.py`` beside itself: it fills Numba's on-disk
cache with every dtype's kernels at the lowest CPU priority, on the core the serial run
leaves idle, so that tests that start several rank processes load compiled code instead of
compiling it. ``FERRODIST_WARM_CACHE=0`` turns it off.

GPU tests run under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set here unless the
environment already says otherwise; run with ``NUMBA_ENABLE_CUDASIM=0`` on a machine with a
GPU). Tests that need real hardware are marked ``gpu`` and skip without one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

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

_WARMER = pytest.StashKey[tuple]()


@pytest.fixture
def checks_made(monkeypatch):
    """The operations whose arguments were checked (each check makes a collectives
    ``Checker``), in order: a call that found its plan from the arguments as given adds none."""
    from ferrodist.collectives import _checks

    made = []
    real = _checks.Checker.__init__

    def counting(self, rank, operation):
        made.append(operation)
        real(self, rank, operation)

    monkeypatch.setattr(_checks.Checker, "__init__", counting)
    return made


#: Start the cache warmer when at least this many tests were collected (not for a few).
WARM_FROM = 300


def pytest_collection_finish(session):  # type: ignore[no-untyped-def]
    if os.environ.get("FERRODIST_WARM_CACHE", "1") == "0" or len(session.items) < WARM_FROM:
        return
    log = tempfile.TemporaryFile()
    warmer = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_warm.py"))],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    session.config.stash[_WARMER] = (warmer, log)


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    """A warmer that failed says so (the tests are unaffected, only slower)."""
    warmer, log = config.stash.get(_WARMER, (None, None))
    if warmer is not None and warmer.poll() not in (None, 0):
        log.seek(0)
        tail = log.read().decode(errors="replace")[-2000:]
        terminalreporter.write_line(f"tests/_warm.py failed (exit {warmer.returncode}); its output:\n{tail}")


def pytest_unconfigure(config):  # type: ignore[no-untyped-def]
    warmer, log = config.stash.get(_WARMER, (None, None))
    if warmer is not None:
        if warmer.poll() is None:
            warmer.kill()
        warmer.wait()
        log.close()
