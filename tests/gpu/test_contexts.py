"""Every thread that calls CUDA makes its device's primary context current first.

On a GPU, a thread that calls the driver without a current context gets
``CUDA_ERROR_INVALID_CONTEXT`` (or, racing Numba's first initialisation,
``CUDA_ERROR_NOT_INITIALIZED``): the ranks of ``run_world``, a group's async worker, DDP
hooks in an autograd thread, a user's own threads. The simulator's driver
(``ferrodist.core.cuda.SIMULATED``) keeps that rule, so these tests fail here the way the
code failed on an H100 when a thread was missed; the control tests take the context
making away and show the refusal.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

import ferrodist.collectives as dist
import ferrodist.core as fc
from _helpers import simulator_only
from ferrodist.core import _cuda
from ferrodist.core import cuda as core_cuda
from ferrodist.testing import run_world

pytest.importorskip("ferrodist.gpu")

pytestmark = simulator_only(
    "the simulator's stand-in driver; on a GPU the real driver enforces the rule in tests/gpu/test_staged_on_gpu.py"
)


def dev(array):
    return fc.as_tensor(np.ascontiguousarray(array)).to("cuda")


def all_reduce_everywhere():
    """Each rank: an async all_reduce (run by the group's worker thread) and one run by a
    thread of the rank's own that never touched CUDA before."""

    def rank_main():
        r = dist.get_rank()
        x = dev(np.arange(6, dtype=np.float32) + r)
        dist.all_reduce(x, async_op=True).wait()
        y = dev(np.full(3, r + 1, np.int64))
        group, failures = dist.default_group(), []

        def fresh():
            try:
                group.all_reduce(y)
            except Exception as exc:  # handed to the rank, which raises it
                failures.append(exc)

        thread = threading.Thread(target=fresh)
        thread.start()
        thread.join()
        if failures:
            raise failures[0]
        return x.to("cpu").numpy(), y.to("cpu").numpy()

    return run_world(2, rank_main, timeout=10.0)


def test_async_work_and_a_users_thread_make_their_own_context():
    for x, y in all_reduce_everywhere():
        np.testing.assert_array_equal(x, 2 * np.arange(6, dtype=np.float32) + 1)
        np.testing.assert_array_equal(y, np.full(3, 3))


def test_without_making_contexts_current_the_driver_refuses(monkeypatch):
    """Control: the same calls with context making switched off fail, naming the missing
    context (the worker thread's first driver call is refused)."""
    monkeypatch.setattr(core_cuda, "on_device", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(_cuda, "on_device", lambda *args, **kwargs: contextlib.nullcontext())
    with pytest.raises(fc.FerrodistError, match="CUDA_ERROR_INVALID_CONTEXT"):
        all_reduce_everywhere()


class RacyNumba:
    """A stand-in for ``numba.cuda`` whose first ``is_available()`` marks the driver
    initialised before it is (as Numba's ``Driver.ensure_initialized`` does), so a second
    thread that asks at that moment goes on with an uninitialised driver."""

    def __init__(self) -> None:
        self.started = False
        self.ready = False
        self.early = 0

    def is_available(self) -> bool:
        if not self.started:
            self.started = True
            time.sleep(0.05)  # cuInit
            self.ready = True
        return True

    def use(self) -> None:
        if not self.ready:
            self.early += 1  # on a GPU: CUDA_ERROR_NOT_INITIALIZED from cuCtxGetCurrent


def _first_use_from_threads(numba: RacyNumba, threads: int = 8) -> None:
    barrier = threading.Barrier(threads)

    def first_use() -> None:
        barrier.wait()
        _cuda.cuda("a test").use()

    workers = [threading.Thread(target=first_use) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def test_the_first_initialisation_is_not_raced_by_other_threads(monkeypatch):
    numba = RacyNumba()
    monkeypatch.setattr(_cuda, "_load", lambda: numba)
    monkeypatch.setattr(_cuda, "_numba_started", [])
    _first_use_from_threads(numba)
    assert numba.early == 0


def test_without_the_lock_a_thread_uses_the_driver_before_it_is_initialised(monkeypatch):
    """Control: the same threads without core's lock reproduce the failure of the H100 run."""
    numba = RacyNumba()
    monkeypatch.setattr(_cuda, "_load", lambda: numba)
    monkeypatch.setattr(_cuda, "_numba_started", [])
    monkeypatch.setattr(_cuda, "_lock", contextlib.nullcontext())
    _first_use_from_threads(numba)
    assert numba.early > 0


def test_on_device_sets_a_context_in_a_bare_thread_and_pushes_over_another():
    driver = core_cuda.SimulatedDriver(devices=2)
    seen = {}

    def bare() -> None:
        seen["before"] = driver.cuCtxGetCurrent()[1]
        core_cuda.on_device(1, cu=driver)  # kept: this thread had none
        seen["kept"] = driver.cuCtxGetCurrent()[1]
        with core_cuda.on_device(0, cu=driver):  # over device 1's: pushed, then popped
            seen["inside"] = driver.cuCtxGetCurrent()[1]
        seen["after"] = driver.cuCtxGetCurrent()[1]
        with core_cuda.on_device(None, cu=driver):  # the current one is kept
            seen["none"] = driver.cuCtxGetCurrent()[1]

    thread = threading.Thread(target=bare)
    thread.start()
    thread.join()
    one, zero = driver.cuDevicePrimaryCtxRetain(1)[1], driver.cuDevicePrimaryCtxRetain(0)[1]
    assert seen == {"before": 0, "kept": one, "inside": zero, "after": one, "none": one}


def test_a_missing_device_is_named():
    driver = core_cuda.SimulatedDriver(devices=1)
    with pytest.raises(fc.InvalidArgument, match=r"cuDeviceGet\(3\) failed: CUDA_ERROR_INVALID_VALUE"):
        core_cuda.on_device(3, cu=driver)
