"""The NCCL route of ``ProcessGroup`` with a stand-in NCCL (``tests/_nccl_standin.py``) under
Numba's CUDA simulator: which calls go device to device, that every rank gets the right
result, and that ferrodist's promises hold there (a mismatch is caught on the CPU channel
before NCCL sees it; a stalled or failing rank fails every rank within its deadline; the
communicator is aborted on failure and closed with the group).

Real NCCL on one GPU: tests/nccl/test_engine_on_gpu.py. Several GPUs: no machine here has them.
"""

from __future__ import annotations

import numpy as np
import pytest

import ferrodist.collectives as dist
import ferrodist.core as fc
from _helpers import simulator_only
from ferrodist.core import CollectiveMismatch, CollectiveTimeout, GroupAborted, ReduceOp
from ferrodist.testing import run_world

pytest.importorskip("ferrodist.nccl")
pytest.importorskip("ferrodist.gpu")
from _nccl_standin import UID, Fabric, use_standin

pytestmark = simulator_only(
    "the stand-in NCCL moves simulated device memory; on a GPU tests/nccl/test_engine_on_gpu.py runs the real one"
)


def dev(array):
    return fc.as_tensor(np.ascontiguousarray(array)).to("cuda")


def host(tensor):
    return tensor.to("cpu").numpy()


def test_every_collective_goes_device_to_device(monkeypatch):
    fabric = Fabric(3)
    use_standin(monkeypatch, fabric)
    n = 4

    def rank_main():
        r, p = dist.get_rank(), dist.get_world_size()
        out = {}
        a = dev(np.arange(n, dtype=np.float32) + r)
        dist.all_reduce(a)
        out["sum"] = host(a)
        m = dev(np.array([r, -r, 5, 7 * r], np.int32))
        dist.all_reduce(m, ReduceOp.MAX)
        out["max"] = host(m)
        avg = dev(np.full(n, 3.0 * r))
        dist.all_reduce(avg, ReduceOp.AVG)
        out["avg"] = host(avg)
        b = dev(np.full(n, 10 * r, np.int64))
        dist.broadcast(b, 1)
        out["broadcast"] = host(b)
        c = dev(np.full(n, r + 1.0))
        dist.reduce(c, 2, ReduceOp.PRODUCT)
        out["reduce"] = host(c)
        listed = [dev(np.zeros(n, np.float64)) for _ in range(p)]
        dist.all_gather(listed, dev(np.full(n, r * 1.5)))
        out["gather_list"] = np.concatenate([host(t) for t in listed])
        whole = dev(np.zeros(p * n, np.int32))
        dist.all_gather(whole, dev(np.arange(n, dtype=np.int32) * 10 + r))
        out["gather_whole"] = host(whole)
        rs = dev(np.zeros(n, np.float32))
        dist.reduce_scatter(rs, dev(np.arange(p * n, dtype=np.float32) + r))
        out["reduce_scatter"] = host(rs)
        rs_list = dev(np.zeros(n, np.float32))
        dist.reduce_scatter(rs_list, [dev(np.full(n, 10.0 * k + r, np.float32)) for k in range(p)])
        out["reduce_scatter_list"] = host(rs_list)
        gathered = [dev(np.zeros(2, np.int8)) for _ in range(p)] if r == 0 else None
        dist.gather(dev(np.full(2, r + 1, np.int8)), gathered, 0)
        out["gather"] = np.concatenate([host(t) for t in gathered]) if gathered else None
        scattered = dev(np.zeros(2, np.int16))
        parts = [dev(np.full(2, 100 + k, np.int16)) for k in range(p)] if r == 2 else None
        dist.scatter(scattered, parts, 2)
        out["scatter"] = host(scattered)
        outs = [dev(np.zeros(k + 1, np.float32)) for k in range(p)]
        dist.all_to_all(outs, [dev(np.full(r + 1, 10.0 * r + k, np.float32)) for k in range(p)])
        out["all_to_all"] = [host(t) for t in outs]
        return out, dist.default_group().cuda_route

    results = run_world(3, rank_main, timeout=20.0)
    p, i = 3, np.arange(n)
    for r, (out, route) in enumerate(results):
        assert route == "nccl"
        np.testing.assert_array_equal(out["sum"], 3 * i + 3)
        np.testing.assert_array_equal(out["max"], [2, 0, 5, 14])
        np.testing.assert_allclose(out["avg"], 3.0)
        np.testing.assert_array_equal(out["broadcast"], 10)
        np.testing.assert_array_equal(out["reduce"], 6.0 if r == 2 else r + 1.0)  # non-roots keep theirs
        np.testing.assert_array_equal(out["gather_list"], np.repeat([0.0, 1.5, 3.0], n))
        np.testing.assert_array_equal(out["gather_whole"], np.concatenate([i * 10 + k for k in range(p)]))
        np.testing.assert_array_equal(out["reduce_scatter"], 3 * np.arange(r * n, (r + 1) * n) + 3)
        np.testing.assert_array_equal(out["reduce_scatter_list"], 30.0 * r + 3)
        if r == 0:
            np.testing.assert_array_equal(out["gather"], [1, 1, 2, 2, 3, 3])
        np.testing.assert_array_equal(out["scatter"], 100 + r)
        for k in range(p):
            np.testing.assert_array_equal(out["all_to_all"][k], np.full(k + 1, 10.0 * k + r))
    assert fabric.uids == {0: UID, 1: UID, 2: UID}  # rank 0's id reached every rank over the CPU channel
    assert all(comm.closed for comm in fabric.comms.values())  # closed with the group


def test_what_nccl_cannot_do_goes_staged_on_every_rank(monkeypatch):
    """Bitwise reductions, NCCL-less dtypes and point-to-point take the staged engine."""
    fabric = Fabric(2)
    use_standin(monkeypatch, fabric)

    def rank_main():
        r = dist.get_rank()
        x = dev(np.array([1, 1], np.float32))
        dist.all_reduce(x)  # the route is chosen here: nccl
        before = fabric.enqueued
        bits = dev(np.array([0b1100 | r, 0b1010], np.int32))
        dist.all_reduce(bits, ReduceOp.BAND)
        small = dev(np.full(3, r + 1, np.uint16))  # NCCL has no uint16 type
        dist.all_reduce(small)
        if r == 0:
            dist.send(dev(np.arange(3.0)), 1)
            got = None
        else:
            got = dev(np.zeros(3))
            dist.recv(got, 0)
            got = host(got)
        return host(bits), host(small), got, fabric.enqueued - before

    (bits0, small0, _, extra0), (bits1, small1, got, extra1) = run_world(2, rank_main, timeout=20.0)
    for bits, small in ((bits0, small0), (bits1, small1)):
        np.testing.assert_array_equal(bits, [0b1100, 0b1010])
        np.testing.assert_array_equal(small, [3, 3, 3])
    np.testing.assert_array_equal(got, [0.0, 1.0, 2.0])
    assert extra0 == extra1 == 0  # nothing of these went through NCCL


def test_bf16_compression_casts_on_the_device_and_reduces_through_nccl(monkeypatch):
    fabric = Fabric(2)
    use_standin(monkeypatch, fabric)
    values = np.array([1.0, 2.5, -3.0, 1e-3], np.float32)

    def rank_main():
        x = dev(values * (dist.get_rank() + 1))
        dist.all_reduce(x, compress="bf16")
        return host(x)

    for got in run_world(2, rank_main, timeout=20.0):
        np.testing.assert_allclose(got, 3 * values, rtol=1e-2)
    assert fabric.enqueued == 2  # one bfloat16 all_reduce per rank


def test_a_mismatch_is_caught_on_the_cpu_channel_before_nccl_sees_it(monkeypatch):
    fabric = Fabric(2)
    use_standin(monkeypatch, fabric)

    def rank_main():
        r = dist.get_rank()
        dist.all_reduce(dev(np.ones(4, np.float32)))
        before = fabric.enqueued
        with pytest.raises((CollectiveMismatch, GroupAborted)) as caught:
            dist.all_reduce(dev(np.ones(4, np.float32)), ReduceOp.SUM if r == 0 else ReduceOp.MAX, timeout=10.0)
        return type(caught.value), str(caught.value), fabric.enqueued - before

    results = run_world(2, rank_main, timeout=20.0)
    assert any(kind is CollectiveMismatch and "op=MAX" in text and "op=SUM" in text for kind, text, _ in results)
    assert [extra for _, _, extra in results] == [0, 0]


def test_a_stalled_rank_fails_every_rank_within_the_deadline(monkeypatch):
    fabric = Fabric(2)
    use_standin(monkeypatch, fabric)

    def rank_main():
        dist.all_reduce(dev(np.ones(2, np.float32)))
        fabric.stall.add(1)  # rank 1's GPU stops running NCCL's work
        with pytest.raises((CollectiveTimeout, GroupAborted)) as caught:
            dist.all_reduce(dev(np.ones(2, np.float32)), timeout=1.0)
        with pytest.raises(GroupAborted):
            dist.all_reduce(dev(np.ones(2, np.float32)))  # the group stays aborted
        return str(caught.value)

    messages = run_world(2, rank_main, timeout=20.0)
    assert any("through NCCL on cuda:0 did not finish before the call's deadline" in m for m in messages), messages
    assert all(comm.aborted for comm in fabric.comms.values())


def test_a_failing_peer_ends_the_nccl_wait_at_once(monkeypatch):
    """Rank 1 fails after the fingerprint check but before enqueueing: rank 0, waiting on
    the GPU, sees the group's abort on the CPU channel instead of waiting out 30 s."""
    fabric = Fabric(2)
    use_standin(monkeypatch, fabric)

    def rank_main():
        r = dist.get_rank()
        dist.all_reduce(dev(np.ones(2, np.float32)))
        if r == 1:
            fabric.comms[1].aborted = True  # its next enqueue raises
        with pytest.raises(fc.FerrodistError) as caught:
            dist.all_reduce(dev(np.ones(2, np.float32)), timeout=30.0)
        return caught.value

    errors = run_world(2, rank_main, timeout=40.0)
    assert not isinstance(errors[0], CollectiveTimeout), errors[0]
    assert "rank 1" in str(errors[0]) and "aborted stand-in communicator" in str(errors[0]), errors[0]
    assert fabric.comms[0].aborted


def test_an_asynchronous_nccl_error_fails_every_rank(monkeypatch):
    fabric = Fabric(2)
    use_standin(monkeypatch, fabric)

    def rank_main():
        dist.all_reduce(dev(np.ones(2, np.float32)))
        fabric.stall.add(0)
        fabric.async_error.add(0)
        with pytest.raises(fc.FerrodistError) as caught:
            dist.all_reduce(dev(np.ones(2, np.float32)), timeout=20.0)
        return caught.value

    errors = run_world(2, rank_main, timeout=40.0)
    assert all(not isinstance(e, CollectiveTimeout) for e in errors), errors
    assert all("ncclRemoteError" in str(e) for e in errors), errors


def test_a_rank_whose_communicator_cannot_start_fails_the_setup_everywhere(monkeypatch):
    fabric = Fabric(2)
    fabric.refuse_init.add(1)
    use_standin(monkeypatch, fabric)

    def rank_main():
        with pytest.raises(fc.FerrodistError) as caught:
            dist.all_reduce(dev(np.ones(2, np.float32)), timeout=5.0)
        return str(caught.value)

    messages = run_world(2, rank_main, timeout=30.0)
    assert all("cuda_route" in m for m in messages), messages
    assert any("ncclCommInitRank failed" in m for m in messages), messages
