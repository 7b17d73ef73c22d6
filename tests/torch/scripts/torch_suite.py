"""torch's own backend-generic distributed suite (``DistributedTest._DistTestBase`` of
``torch/testing/_internal/distributed/distributed_test.py``) on a backend, at ``WORLD_SIZE``
ranks (2 when not set).

    python tests/torch/scripts/torch_suite.py ferrodist OUT.json [NAME ...]
    python tests/torch/scripts/torch_suite.py gloo OUT.json            # torch's own, for reference

It does what torch's ``test/distributed/test_distributed_spawn.py`` does (``BACKEND``,
``WORLD_SIZE``, ``TEMP_DIR`` and ``INIT_METHOD`` in the environment, a class made of
``TestDistBackend`` and ``_DistTestBase``), with two differences:

- the ranks are forked from this process rather than spawned (each test starts its
  processes; a fresh interpreter importing torch would cost about a second each). On
  ``ferrodist`` this process first loads the backend and its kernels
  (``ferrodist.torch.preload``), as it has loaded torch and Gloo, so that a forked rank
  imports and loads nothing;
- on ``ferrodist``, torch's decorators choose the tests as for Gloo: ``BACKEND`` is
  ``gloo`` while the suite is imported (torch's ``skip_if`` decorators compare it with
  ``"gloo"`` and skip most tests for any other name), and ``ferrodist`` from then on, so
  every process group the tests make, the default one included, is a ferrodist group.
  torch's features table (``DistTestCases.backend_feature``) lists ferrodist wherever it
  lists Gloo. One body chooses its model by comparing the name with ``"gloo"``
  (``_test_accumulate_gradients_no_sync``: nothing is set up for any other name); it runs
  with the name ``gloo`` and a check that the default group is ferrodist's.

Without NAMEs it runs every test of the class; each NAME is a test (``test_barrier``).
Writes ``{"seconds": ..., "tests": {name: [outcome, seconds, detail]}}`` to OUT.json,
outcome being ``pass``, ``fail``, ``error`` or ``skip``. ``FERRODIST_TORCH_TRANSPORT``
picks the transport as it does for any job.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import unittest
from contextlib import contextmanager
from typing import Any

BACKEND = sys.argv[1]
OUT = sys.argv[2]
NAMES = sys.argv[3:]

os.environ["BACKEND"] = "gloo" if BACKEND == "ferrodist" else BACKEND
os.environ.setdefault("WORLD_SIZE", "2")  # the ranks of every test
os.environ.setdefault("INIT_METHOD", "env://")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")  # torch's per-test deadline (300 s)
PLACE = os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="torch-suite-")  # each test makes its own too
os.makedirs(os.path.join(PLACE, "barrier"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

if BACKEND == "ferrodist":
    import ferrodist.torch  # (torch registers it too, unless TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    ferrodist.torch.preload()  # the ranks are forked from here: as torch and Gloo, ferrodist is loaded once

    distributed_test.BACKEND = os.environ["BACKEND"] = "ferrodist"
    for backends in DistTestCases.backend_feature.values():
        if "gloo" in backends:
            backends.add("ferrodist")


@contextmanager
def named_gloo() -> Any:
    """The suite's ``BACKEND`` reads ``gloo`` inside (the default group stays ferrodist's)."""
    assert dist.get_backend() == BACKEND, dist.get_backend()
    distributed_test.BACKEND = "gloo"
    try:
        yield
    finally:
        distributed_test.BACKEND = BACKEND


class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    if BACKEND == "ferrodist":

        def _test_accumulate_gradients_no_sync(self, *args: Any, **kwargs: Any) -> Any:
            with named_gloo():
                return super()._test_accumulate_gradients_no_sync(*args, **kwargs)


class Outcomes(unittest.TextTestResult):
    """Each test's outcome, seconds and detail (the traceback, or the reason for a skip)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows: dict[str, list[Any]] = {}
        self._started: dict[str, float] = {}

    def startTest(self, test: unittest.TestCase) -> None:
        self._started[test.id()] = time.monotonic()
        super().startTest(test)

    def _note(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        took = time.monotonic() - self._started.get(test.id(), time.monotonic())
        self.rows[test.id().rsplit(".", 1)[-1]] = [outcome, round(took, 3), detail[-4000:]]

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._note(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._note(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._note(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._note(test, "skip", reason)


def main() -> None:
    every = sorted(name for name in dir(TorchSuite) if name.startswith("test_"))
    unknown = [name for name in NAMES if name not in every]
    if unknown:
        raise SystemExit(f"not tests of torch's suite: {unknown}")
    chosen = NAMES or every
    start = time.monotonic()
    runner = unittest.TextTestRunner(resultclass=Outcomes, stream=sys.stderr, verbosity=1)
    result = runner.run(unittest.TestSuite(TorchSuite(name) for name in chosen))
    assert isinstance(result, Outcomes)
    with open(OUT, "w") as out:
        json.dump({"seconds": round(time.monotonic() - start, 1), "tests": result.rows}, out, indent=1)
    shutil.rmtree(os.environ.get("TEMP_DIR", PLACE), ignore_errors=True)
    shutil.rmtree(PLACE, ignore_errors=True)


if __name__ == "__main__":
    main()
