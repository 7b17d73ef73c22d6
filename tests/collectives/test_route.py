"""One route per call: check, plan, run. A plan is made once per kind of call, printed
with FERRODIST_DEBUG=route, and found again from the arguments as given, for numpy
arrays and torch CPU tensors alike, without the checks."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

import ferrodist.collectives as dist
from ferrodist.core import CollectiveMismatch, InvalidArgument, ReduceOp, host_view
from ferrodist.testing import run_world


def test_each_kind_of_call_is_planned_once_and_printed_with_its_route(monkeypatch, capsys):
    monkeypatch.setenv("FERRODIST_DEBUG", "route")

    def rank_main():
        for _ in range(3):
            dist.all_reduce(np.ones(4, np.float32))
        dist.all_reduce(np.ones(4, np.float32), "avg")
        dist.all_reduce(np.ones(100_000, np.float32))
        dist.broadcast(np.ones(2), src=1)
        dist.barrier()
        dist.barrier()

    run_world(2, rank_main)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[ferrodist] rank ")]
    for rank in (0, 1):
        mine = sorted(line.split(": ", 2)[2] for line in lines if line.startswith(f"[ferrodist] rank {rank}:"))
        shapes = [re.sub(r" \[fingerprint 0x[0-9a-f]+\]$", "", line) for line in mine]
        assert shapes == [
            "all_reduce float32 x100000 SUM -> ring",
            "all_reduce float32 x4 AVG -> recursive_doubling (then divided by 2)",
            "all_reduce float32 x4 SUM -> recursive_doubling",
            "barrier -> dissemination",
            "broadcast float64 x2 root 1 -> tree",
        ], mine


def test_a_call_seen_before_skips_the_checks_and_a_changed_array_does_not(checks_made):
    made = checks_made
    dist.init_process_group("simulated")
    try:
        x = np.ones(8, np.float32)
        for _ in range(5):
            dist.all_reduce(x)
        assert made == ["all_reduce"]
        dist.all_reduce(x.reshape(2, 4))  # same elements, same plan: a view is as good as the array
        assert made == ["all_reduce"]
        x.flags.writeable = False  # a plan never skips what changed: this one is refused
        with pytest.raises(InvalidArgument, match="read-only"):
            dist.all_reduce(x)
        y = np.ones(16, np.float32)[::2]  # not contiguous: checked, and refused
        with pytest.raises(InvalidArgument, match="contiguous"):
            dist.all_reduce(y)
    finally:
        dist.destroy_process_group()


def test_torch_cpu_tensors_take_the_same_plan_without_conversion(checks_made):
    torch = pytest.importorskip("torch")
    made = checks_made

    def rank_main():
        rank = dist.get_rank()
        t = torch.full((3,), float(rank + 1))
        for _ in range(4):
            dist.all_reduce(t)
        half = torch.full((2,), float(rank + 1), dtype=torch.bfloat16)
        dist.all_reduce(half)
        dist.all_reduce(half)
        out = torch.empty(4)
        dist.all_gather(out, torch.full((2,), float(rank)))
        dist.all_gather(out, torch.full((2,), float(rank)))
        return t.tolist(), half.float().tolist(), out.tolist()

    results = run_world(2, rank_main)
    assert results == [([3.0 * 2**3] * 3, [6.0, 6.0], [0.0, 0.0, 1.0, 1.0])] * 2
    # one check per rank per kind of call: the repeats found their plan from the tensors as given
    assert sorted(made) == ["all_gather"] * 2 + ["all_reduce"] * 4


def test_host_view_sees_host_arrays_and_leaves_the_rest_to_as_tensor():
    a = np.arange(6.0).reshape(2, 3)
    assert host_view(a) is a
    assert host_view(a.T) is None  # not contiguous: as_tensor says why
    assert host_view([1.0, 2.0]) is None
    torch = pytest.importorskip("torch")
    t = torch.arange(4.0, requires_grad=True)
    view = host_view(t)
    assert view is not None and view.dtype == np.float32
    view[0] = 7.0
    assert t[0].item() == 7.0  # the same memory
    assert host_view(torch.arange(6.0).reshape(2, 3).T) is None


def test_a_plan_is_a_frozen_value_that_says_what_it_does():
    dist.init_process_group("simulated")
    try:
        group = dist.default_group()
        dist.all_reduce(np.ones(3), ReduceOp.MAX)
        plan = group._route.known(("all_reduce", np.dtype(np.float64), 3, ReduceOp.MAX, None, None))
        assert plan is not None
        assert str(plan).startswith("all_reduce float64 x3 MAX -> recursive_doubling [fingerprint 0x")
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.route = "ring"  # type: ignore[misc]
    finally:
        dist.destroy_process_group()


def _shm_pair(fn: Any, token: bytes) -> list[Any]:
    """``fn(group, rank)`` on 2 ranks (threads) of one world over the shm transport; each
    rank's result or exception."""
    import threading

    from _helpers import free_port
    from ferrodist.transport import ShmTransport

    port = free_port()
    out: list[Any] = [None, None]

    def rank_main(rank: int) -> None:
        transport = ShmTransport.connect(
            rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=30, token=token
        )
        try:
            group = dist.ProcessGroup(transport, range(2), 0, timeout=30, name="world")
            out[rank] = fn(group, rank)
            group._shutdown(5.0)
        except BaseException as exc:
            out[rank] = exc
        finally:
            transport.close()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a rank was still running after 120 s"
    return out


def test_a_known_small_all_reduce_over_shm_runs_the_bound_collective_with_no_call_made(monkeypatch):
    """Over shared memory, the plan of a one-slot all_reduce holds the arena's collective
    bound to its dtype and op; a known call runs it with no ``Call`` object, and back-to-back
    calls with new data each get every rank's sum. Larger calls keep the general body."""
    import threading

    from ferrodist.collectives import _runner

    made: list[int] = []
    real = _runner.Call

    def counted(*args: object) -> object:
        made.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(_runner, "Call", counted)

    def body(group: dist.ProcessGroup, rank: int) -> Any:
        small, large = np.zeros(1024, np.float32), np.zeros(1 << 20, np.float32)
        group.all_reduce(small)  # checked and planned
        group.all_reduce(large)
        plans = [group._route.known(("all_reduce", a.dtype, a.size, ReduceOp.SUM, None, None)) for a in (small, large)]
        before = made.count(threading.get_ident())
        sums = []
        for step in range(50):
            small[...] = np.arange(1024) * (rank + 1) + step
            group.all_reduce(small)
            sums.append(bool((small == np.arange(1024) * 3 + 2 * step).all()))
        calls_made = made.count(threading.get_ident()) - before
        return plans[0].native_call is not None, plans[1].native_call is None, sums, calls_made

    for result in _shm_pair(body, b"bound-test"):
        assert not isinstance(result, BaseException), result
        bound, general, sums, calls_made = result
        assert bound and general
        assert all(sums), sums
        assert calls_made == 0  # no Call object for the 50 known calls


def test_a_small_async_all_reduce_over_shm_runs_at_once_unless_calls_are_ahead_of_it():
    """``async_op=True`` on a one-slot all_reduce with nothing ahead of it runs on the caller's
    thread (its work is done when the call returns; no worker is started); behind a queued
    call it goes to the worker, in order. A failure is the work's, raised by ``wait``."""

    def body(group: dist.ProcessGroup, rank: int) -> Any:
        small = np.full(256, rank + 1.0, np.float32)
        group.all_reduce(small)  # planned
        small[...] = rank + 1.0
        work = group.all_reduce(small, async_op=True)
        at_once = (work.is_completed(), group._runner._worker is None, float(small[0]))
        work.wait()
        large = np.full(1 << 20, rank + 1.0, np.float32)
        queued = group.all_reduce(large, async_op=True)  # on the worker
        small[...] = 10.0 * (rank + 1)
        behind = group.all_reduce(small, async_op=True)  # behind it: on the worker too
        behind.wait()
        queued.wait()
        in_order = (float(large[0]), float(small[0]))
        odd = np.ones(256 + 44 * rank, np.float32)  # the ranks disagree on the size
        failing = group.all_reduce(odd, async_op=True)  # no exception here: the work has it
        try:
            failing.wait()
            error = None
        except CollectiveMismatch as exc:
            error = type(exc).__name__
        return at_once, in_order, error

    results = _shm_pair(body, b"async-test")
    for result in results:
        assert not isinstance(result, BaseException), result
        at_once, in_order, error = result
        assert at_once == (True, True, 3.0)
        assert in_order == (3.0, 30.0)
        assert error == "CollectiveMismatch"
