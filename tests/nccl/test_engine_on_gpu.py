"""The NCCL route on a real GPU: a group of one rank takes it (its rank has a GPU of its
own), every collective runs through the real ``libnccl.so.2``; ranks sharing the GPU take
the staged route and say why. Needs a CUDA GPU and ``NUMBA_ENABLE_CUDASIM=0`` (skipped
otherwise, with the reason). Two ranks on two GPUs need a machine with two GPUs."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ferrodist.collectives as dist
import ferrodist.core as fc
from ferrodist.core import ReduceOp
from ferrodist.testing import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu")]  # the fixture skips without a GPU
pytest.importorskip("ferrodist.gpu")


@pytest.fixture(autouse=True)
def _not_simulated():
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM=1: the CUDA simulator has no NCCL (run with NUMBA_ENABLE_CUDASIM=0)")


def dev(array):
    return fc.as_tensor(np.ascontiguousarray(array)).to("cuda")


def test_a_group_of_one_rank_runs_every_collective_through_nccl():
    def rank_main():
        x = dev(np.arange(1000, dtype=np.float32))
        dist.all_reduce(x, ReduceOp.AVG)
        y = dev(np.arange(7, dtype=np.int64))
        dist.broadcast(y, 0)
        out = dev(np.zeros(1000, np.float32))
        dist.all_gather(out, x)
        rs = dev(np.zeros(1000, np.float32))
        dist.reduce_scatter(rs, x)
        z = dev(np.arange(6, dtype=np.float32))
        dist.all_reduce(z, compress="bf16")
        return [t.to("cpu").numpy() for t in (x, y, out, rs, z)], dist.default_group().cuda_route

    (x, y, out, rs, z), route = run_world(1, rank_main)[0]
    assert route == "nccl"
    np.testing.assert_array_equal(x, np.arange(1000, dtype=np.float32))
    np.testing.assert_array_equal(y, np.arange(7))
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(rs, x)
    np.testing.assert_array_equal(z, np.arange(6, dtype=np.float32))


def test_ranks_sharing_one_gpu_take_the_staged_route():
    def rank_main():
        x = dev(np.full(4, dist.get_rank() + 1.0))
        dist.all_reduce(x)
        return x.to("cpu").numpy(), dist.default_group().cuda_route

    for x, route in run_world(2, rank_main):
        np.testing.assert_array_equal(x, 3.0)
        assert route == "staged"
