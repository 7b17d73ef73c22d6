"""The staging engine's raw copies and their ordering, without a GPU.

``LazyDriver`` stands in for the CUDA driver the way a real GPU behaves at its worst: a
copy queued on a stream happens only when something waits for it (an event query that
finds it done, or another stream made to wait for that event), and a query says "not
ready" twice before it looks. An engine that reads a host buffer before its copy down is
known to be done, refills a buffer still being copied up, or returns before its last
copy up, computes from stale bytes here, and the results are checked against numpy.
The control tests take one wait away and show that the checks then fail.

``LazyDriver`` is a stand-in for the simulator's device memory (host memory): these tests
run only under ``NUMBA_ENABLE_CUDASIM=1`` and skip on a GPU, where its copies would
``memmove`` real device pointers.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import numpy as np
import pytest

import ferrodist.collectives as dist
import ferrodist.core as fc
from _helpers import simulator_only
from ferrodist.core import CollectiveMismatch, CollectiveTimeout, ReduceOp
from ferrodist.testing import run_world

gpu = pytest.importorskip("ferrodist.gpu")
from ferrodist.core.cuda import SIMULATED, SimulatedDriver  # noqa: E402
from ferrodist.gpu import _copies, _staged  # noqa: E402

NOT_READY = 600

pytestmark = simulator_only(
    "stand-in drivers copy host memory; on a GPU, tests/gpu/test_staged_on_gpu.py covers the real copies"
)


class LazyDriver(SimulatedDriver):
    """The driver calls ``Copies`` makes, on host memory (the simulator's device memory),
    each copy deferred until it must have happened. Like the simulator's driver, it
    refuses calls from a thread without a current context."""

    def __init__(self, not_ready: int = 2, stall: bool = False) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.queues: dict[int, list] = {}  # stream -> pending operations, in order
        self.events: dict[int, tuple[int, int]] = {}  # event -> (stream, operations queued before it)
        self.done: dict[int, int] = {}  # stream -> operations run so far
        self.polls: dict[int, int] = {}
        self.handles = 0
        self.not_ready, self.stall = not_ready, stall
        self.copies = 0

    def _handle(self) -> int:
        with self.lock:
            self.handles += 1
            return self.handles

    def cuStreamCreate(self, flags):
        if not self.has_context():
            return super().cuStreamCreate(flags)
        stream = self._handle()
        self.queues[stream], self.done[stream] = [], 0
        return 0, stream

    def cuEventCreate(self, flags):
        if not self.has_context():
            return super().cuEventCreate(flags)
        return 0, self._handle()

    def _run_until(self, stream: int, count: int) -> None:
        while self.done[stream] < count:
            operation = self.queues[stream][self.done[stream]]
            self.done[stream] += 1
            operation()

    def copy(self, dst, src, nbytes, stream):
        self.copies += 1
        self.queues[stream].append(lambda: ctypes.memmove(dst, src, nbytes))
        return (0,)

    def cuEventRecord(self, event, stream):
        if not self.has_context():
            return super().cuEventRecord(event, stream)
        self.events[event] = (stream, len(self.queues[stream]))
        self.polls[event] = 0
        return (0,)

    def cuStreamWaitEvent(self, stream, event, flags):
        if not self.has_context():
            return super().cuStreamWaitEvent(stream, event, flags)
        other, count = self.events[event]
        self.queues[stream].append(lambda: self._run_until(other, count))
        return (0,)

    def cuEventQuery(self, event):
        if not self.has_context():
            return super().cuEventQuery(event)
        self.polls[event] += 1
        if self.stall or self.polls[event] <= self.not_ready:
            return (NOT_READY,)
        stream, count = self.events[event]
        self._run_until(stream, count)
        return (0,)

    def cuGetErrorName(self, err):
        return 0, {NOT_READY: b"CUDA_ERROR_NOT_READY", 201: b"CUDA_ERROR_INVALID_CONTEXT"}.get(
            err, b"CUDA_ERROR_UNKNOWN"
        )

    def cuGetErrorString(self, err):
        return 0, b"stand-in"


@contextlib.contextmanager
def staged_with(driver, segment_bytes):
    """The process's engine copying through ``driver`` with segments of ``segment_bytes``
    (rank threads of ``run_world`` make their streams from it on their first call)."""
    engine = gpu.engine()
    saved = engine.driver, engine.segment_bytes
    engine.driver, engine.segment_bytes = driver, segment_bytes
    try:
        yield engine
    finally:
        engine.driver, engine.segment_bytes = saved


def dev(array):
    return fc.as_tensor(np.ascontiguousarray(array)).to("cuda")


def every_collective(size, n, root):
    """all_reduce, broadcast, reduce, all_gather and reduce_scatter of known inputs, each
    result on the host, per rank."""

    def rank_main():
        r = dist.get_rank()
        a = dev(np.arange(n, dtype=np.float64) + 100 * r)
        dist.all_reduce(a)
        b = dev(np.arange(n, dtype=np.int32) * (r + 1))
        dist.broadcast(b, root)
        c = dev(np.arange(n, dtype=np.float32) + r)
        dist.reduce(c, root, ReduceOp.MAX)
        gathered = dev(np.zeros(size * n, np.int64))
        dist.all_gather(gathered, dev(np.arange(n, dtype=np.int64) * 10 + r))
        scattered = dev(np.zeros(n, np.float64))
        dist.reduce_scatter(scattered, dev(np.arange(size * n, dtype=np.float64) + r))
        return [t.to("cpu").numpy() for t in (a, b, c, gathered, scattered)]

    return run_world(size, rank_main)


def check_every_collective(results, size, n, root):
    i = np.arange(n)
    for r, (a, b, c, gathered, scattered) in enumerate(results):
        np.testing.assert_array_equal(a, size * i + 100 * sum(range(size)), err_msg=f"all_reduce, rank {r}")
        np.testing.assert_array_equal(b, i * (root + 1), err_msg=f"broadcast, rank {r}")
        if r == root:
            np.testing.assert_array_equal(c, i + size - 1, err_msg=f"reduce, rank {r}")
        expected = np.concatenate([i * 10 + k for k in range(size)])
        np.testing.assert_array_equal(gathered, expected, err_msg=f"all_gather, rank {r}")
        block = np.arange(r * n, (r + 1) * n, dtype=np.float64)
        np.testing.assert_array_equal(scattered, size * block + sum(range(size)), err_msg=f"reduce_scatter, rank {r}")


@pytest.mark.parametrize(("size", "n", "segment"), [(2, 100, 64), (3, 37, 48), (2, 5, 4096), (3, 0, 64)])
def test_deferred_copies_give_right_results(size, n, segment):
    """Many segments (64 bytes: 8 float64 per part, three buffers reused over and over),
    one segment, and empty tensors, with every copy deferred as long as it may be."""
    driver = LazyDriver()
    with staged_with(driver, segment):
        results = every_collective(size, n, root=size - 1)
    check_every_collective(results, size, n, root=size - 1)
    assert n == 0 or driver.copies > 0


@pytest.mark.parametrize("missing", ["wait_down", "wait_up", "down_after_up"])
def test_without_each_wait_the_deferred_driver_gives_wrong_results(missing, monkeypatch):
    """Control: the checks above notice an engine that skips a wait (here: one of the
    three), so passing them means the engine waits where it must."""
    monkeypatch.setattr(_copies.Copies, missing, lambda self, *args: None)
    with staged_with(LazyDriver(not_ready=0), 64):
        results = every_collective(2, 100, root=1)
    with pytest.raises(AssertionError):
        check_every_collective(results, 2, 100, root=1)


def test_a_copy_that_never_finishes_times_out_naming_the_copy():
    """A GPU that never completes a copy: the call raises within its deadline on every
    rank (the rank stuck in its copy, and the peer it leaves waiting)."""

    def rank_main():
        with pytest.raises((CollectiveTimeout, fc.GroupAborted, fc.PeerLost)) as caught:
            dist.all_reduce(dev(np.ones(16, np.float32)), timeout=1.0)
        return str(caught.value)

    with staged_with(LazyDriver(stall=True), 4096):
        messages = run_world(2, rank_main)
    assert any("copy device to host did not finish" in m for m in messages), messages


def test_ranks_that_cut_a_tensor_differently_raise_a_mismatch(monkeypatch):
    """Each part carries its element count in the call's fingerprint: ranks whose segments
    differ (another FERRODIST_GPU_SEGMENT_BYTES) fail the call instead of combining
    unrelated bytes."""
    whole = _staged.parts

    def uneven(n, per):
        return whole(n, 3 if dist.get_rank() == 0 else 5)

    monkeypatch.setattr(_staged, "parts", uneven)

    def rank_main():
        with pytest.raises((CollectiveMismatch, fc.GroupAborted)) as caught:
            dist.all_reduce(dev(np.ones(20, np.float32)), timeout=10.0)
        return type(caught.value).__name__, str(caught.value)

    results = run_world(2, rank_main)
    assert any(name == "CollectiveMismatch" and "x 3" in text and "x 5" in text for name, text in results), results


def test_the_simulated_driver_copies_at_once():
    src, dst = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
    with fc.cuda.on_device(0, cu=SIMULATED):
        copies = _copies.Copies(SIMULATED, 1)
        copies.down(dst.ctypes.data, src.ctypes.data, 8)
        copies.downed(0)
        copies.wait_down(0, deadline=float("inf"), rank=0)
    np.testing.assert_array_equal(dst, src)


def test_driver_errors_name_the_call_and_the_error():
    class Failing(LazyDriver):
        def cuMemcpyDtoHAsync(self, dst, src, nbytes, stream):
            return (999,)

    driver = Failing()
    with fc.cuda.on_device(0, cu=driver):
        copies = _copies.Copies(driver, 1)
        with pytest.raises(fc.FerrodistError, match=r"cuMemcpyDtoHAsync of 8 bytes failed: CUDA_ERROR_UNKNOWN"):
            copies.down(1, 2, 8)


def test_a_thread_without_a_context_is_refused_as_a_gpu_would():
    """The stand-in drivers keep the driver's rule: no current context, no stream."""
    driver = LazyDriver()
    outcome = []

    def fresh_thread():
        try:
            _copies.Copies(driver, 1)
        except fc.FerrodistError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    assert outcome and "CUDA_ERROR_INVALID_CONTEXT" in outcome[0] and "on_device" in outcome[0], outcome
