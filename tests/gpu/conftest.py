"""GPU kernel tests: Numba's CUDA simulator unless the environment chose otherwise.

``NUMBA_ENABLE_CUDASIM`` is read when numba is first imported, so it is set here, at
import, before any test module imports ``numba.cuda``. If numba was already imported
without it (by another test directory), its configuration is read again; if
``numba.cuda`` itself was already imported for real hardware, that choice stands.
Run with ``NUMBA_ENABLE_CUDASIM=0`` on a machine with a GPU to test the real kernels.
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if "numba" in sys.modules and "numba.cuda" not in sys.modules:
    from numba.core import config

    config.reload_config()


@pytest.fixture(scope="session")
def cuda():
    """``numba.cuda`` (the simulator under ``NUMBA_ENABLE_CUDASIM=1``), or skip without a device."""
    from numba import cuda as module

    if not module.is_available():
        pytest.skip("no CUDA device: set NUMBA_ENABLE_CUDASIM=1 to run these tests on Numba's CUDA simulator")
    return module


@pytest.fixture(scope="module")
def staged_route():
    """For tests of the staged engine: their groups ask for the staged route (on a machine
    with a GPU, a world of one rank, with a GPU of its own, would take the NCCL route)."""
    saved = os.environ.get("FERRODIST_CUDA_ROUTE")
    os.environ["FERRODIST_CUDA_ROUTE"] = "staged"
    yield
    if saved is None:
        os.environ.pop("FERRODIST_CUDA_ROUTE", None)
    else:
        os.environ["FERRODIST_CUDA_ROUTE"] = saved
