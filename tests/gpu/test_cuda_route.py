"""Which engine a group's CUDA tensors take, chosen once per group in its first collective on
them, with every rank agreeing (Numba's CUDA simulator; the NCCL engine is the stand-in of
``tests/_nccl_standin.py`` where a test needs one that can run)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import ferrodist.collectives as dist
import ferrodist.core as fc
from _helpers import simulator_only
from ferrodist.core import CollectiveMismatch, DeviceUnavailable, GroupAborted, InvalidArgument
from ferrodist.testing import run_world

pytest.importorskip("ferrodist.gpu")
pytest.importorskip("ferrodist.nccl")
from _nccl_standin import Fabric, use_standin

pytestmark = simulator_only("simulated device memory, and a stand-in NCCL where NCCL must run")


def dev(array):
    return fc.as_tensor(np.ascontiguousarray(array)).to("cuda")


def first_cuda_call(group=None):
    x = dev(np.full(3, dist.get_rank() + 1.0))
    dist.all_reduce(x, group=group)
    return x.to("cpu").numpy()


def test_on_the_simulator_cuda_tensors_are_staged_and_the_choice_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="ferrodist.collectives")

    def rank_main():
        assert dist.default_group().cuda_route is None  # not chosen before the first CUDA call
        got = first_cuda_call()
        return got, dist.default_group().cuda_route

    for got, route in run_world(2, rank_main):
        np.testing.assert_array_equal(got, 3.0)
        assert route == "staged"
    logged = [r.getMessage() for r in caplog.records if "CUDA tensors go through" in r.getMessage()]
    assert len(logged) == 2 and all("staged engine" in m and "simulator" in m for m in logged), logged


def test_nccl_asked_for_where_it_cannot_run_fails_every_rank_naming_why():
    def rank_main():
        group = dist.new_group(cuda_route="nccl")
        with pytest.raises(DeviceUnavailable) as caught:
            first_cuda_call(group)
        with pytest.raises(GroupAborted):
            first_cuda_call(group)
        return str(caught.value)

    for message in run_world(2, rank_main):
        assert "'nccl' was asked for but cannot run: rank 0 cannot: Numba's CUDA simulator" in message, message


def test_ranks_asking_for_different_routes_fail_every_rank_naming_them():
    def rank_main():
        group = dist.new_group(cuda_route="staged" if dist.get_rank() == 1 else "auto")
        with pytest.raises(InvalidArgument) as caught:
            first_cuda_call(group)
        return str(caught.value)

    for message in run_world(3, rank_main):
        assert "ranks [0, 2] asked for 'auto'; rank 1 asked for 'staged'" in message, message


@pytest.mark.parametrize(
    ("options", "route"), [({}, "nccl"), ({"shared_gpu": True}, "staged"), ({"usable": {0}}, "staged")]
)
def test_nccl_only_where_every_rank_has_a_gpu_of_its_own(monkeypatch, options, route):
    use_standin(monkeypatch, Fabric(2), **options)

    def rank_main():
        got = first_cuda_call()
        return got, dist.default_group().cuda_route

    for got, chosen in run_world(2, rank_main):
        np.testing.assert_array_equal(got, 3.0)
        assert chosen == route


def test_each_group_chooses_once_and_subgroups_for_themselves(monkeypatch):
    fabric = Fabric(2)
    use_standin(monkeypatch, fabric)

    def rank_main():
        first_cuda_call()
        first_cuda_call()
        staged = dist.new_group(cuda_route="staged")
        first_cuda_call(staged)
        return dist.default_group().cuda_route, staged.cuda_route

    assert run_world(2, rank_main) == [("nccl", "staged")] * 2
    assert len(fabric.comms) == 2  # one communicator per rank: the world's


def test_a_cuda_tensor_on_one_rank_and_a_cpu_tensor_on_another_is_a_mismatch():
    """The rank with the CUDA tensor starts the route setup while its peer runs a CPU
    all_reduce: both are told, instead of exchanging bytes that mean different things."""

    def rank_main():
        r = dist.get_rank()
        x = dev(np.ones(4)) if r == 0 else np.ones(4)
        with pytest.raises((CollectiveMismatch, GroupAborted)) as caught:
            dist.all_reduce(x, timeout=10.0)
        return type(caught.value), str(caught.value)

    results = run_world(2, rank_main)
    assert any(kind is CollectiveMismatch and "cuda_route" in text for kind, text in results), results


def test_debug_route_prints_the_choice(monkeypatch, capsys):
    monkeypatch.setenv("FERRODIST_DEBUG", "route")
    run_world(2, first_cuda_call)
    out = capsys.readouterr().out
    assert "group world: CUDA route staged (not every rank can run NCCL" in out, out
