"""The "ferrodist" torch.distributed backend in this process: registration, a world of one
started through torch's stores, the errors a user meets, and torch groups over simulated
ranks (threads) for what needs two ranks: results, futures and failures as torch's C++
reads them (DDP's reducer does). Real processes under torchrun: test_torchrun.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytest.importorskip("ferrodist.torch", reason="ferrodist-torch is not installed (pip install packages/torch)")
import ferrodist.torch  # noqa: E402
from ferrodist.collectives import ProcessGroup  # noqa: E402
from ferrodist.core import CollectiveMismatch, FerrodistError, InvalidArgument, InvalidRank  # noqa: E402
from ferrodist.torch import FerrodistProcessGroup, FerrodistWork, choose_transport  # noqa: E402
from ferrodist.transport import SimulatedTransport  # noqa: E402

#: The longest any thread of these tests may take.
LIMIT = 60.0


@pytest.fixture
def world_of_one():
    """A default torch group of one rank on backend "ferrodist", through a HashStore."""
    dist.init_process_group("ferrodist", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def torch_world(size: int, fn: Callable[[FerrodistProcessGroup], Any], *, timeout: float = 10.0) -> list[Any]:
    """``fn(group)`` on ``size`` ranks (threads), each with a ``FerrodistProcessGroup`` over a
    simulated transport, as torch's creator builds it; each rank's result or exception."""
    transports = SimulatedTransport.create_group(size, timeout=timeout)
    out: list[Any] = [None] * size

    def rank(r: int) -> None:
        group = None
        try:
            inner = ProcessGroup(transports[r], range(size), 0, timeout=timeout, name="torch:test")
            group = FerrodistProcessGroup(inner, None, description="test")
            out[r] = fn(group)
        except BaseException as exc:
            out[r] = exc
        finally:
            if group is not None:
                group.shutdown()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(LIMIT)
    assert not any(t.is_alive() for t in threads), f"a rank was still running after {LIMIT} s"
    return out


# -- registration ----------------------------------------------------------------------------------


def test_importing_registers_the_backend_for_cpu_and_cuda_once():
    assert "ferrodist" in dist.Backend.backend_list
    assert dist.is_backend_available("ferrodist")
    assert dist.Backend.backend_capability["ferrodist"] == ["cpu", "cuda"]
    before = list(dist.Backend.backend_list)
    ferrodist.torch.register()  # again: nothing changes
    assert dist.Backend.backend_list == before


def test_public_names():
    assert sorted(ferrodist.torch.__all__) == [
        "BACKEND_NAME",
        "FerrodistProcessGroup",
        "FerrodistWork",
        "TRANSPORTS",
        "choose_transport",
        "register",
    ]
    assert ferrodist.torch.BACKEND_NAME == "ferrodist"


# -- a world of one ------------------------------------------------------------------------------------


def test_a_world_of_one_through_a_hash_store(world_of_one):
    assert dist.get_backend() == "ferrodist"
    assert dist.get_backend(world_of_one) == "ferrodist"
    assert isinstance(world_of_one, FerrodistProcessGroup)
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    x = torch.arange(6.0)
    dist.all_reduce(x)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
    assert isinstance(work, FerrodistWork)
    assert work.get_future().wait()[0] is x  # the future carries the tensor itself
    assert work.is_completed() and work.is_success()
    outs = [torch.zeros(6)]
    dist.all_gather(outs, x)
    assert torch.equal(outs[0], x)
    t = torch.ones(4, 3).T  # not contiguous: staged and copied back
    dist.all_reduce(t)
    assert torch.equal(t, torch.ones(3, 4))
    dist.barrier()


def test_a_world_of_one_through_a_file_store(tmp_path):
    dist.init_process_group("ferrodist", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dist.get_backend() == "ferrodist"
        sub = dist.new_group([0])
        assert dist.get_backend(sub) == "ferrodist"
        x = torch.full((3,), 2.0)
        dist.broadcast(x, src=0, group=sub)
        assert x.tolist() == [2.0, 2.0, 2.0]
        assert "over TcpTransport" in repr(dist.group.WORLD)  # nothing to share memory with
    finally:
        dist.destroy_process_group()


# -- what a user gets wrong -------------------------------------------------------------------------------


def test_an_unsupported_reduce_op_is_named_with_the_ops_there_are(world_of_one):
    with pytest.raises(InvalidArgument, match=r"rank 0: allreduce: ReduceOp.PREMUL_SUM is not supported.*use SUM"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))


def test_an_unsupported_dtype_is_named_with_what_to_use(world_of_one):
    with pytest.raises(InvalidArgument, match=r"rank 0: allreduce: torch.float8_e4m3fn tensors are not supported"):
        dist.all_reduce(torch.ones(2).to(torch.float8_e4m3fn))


def test_a_tensor_on_another_device_is_named(world_of_one):
    with pytest.raises(InvalidArgument, match=r"rank 0: allreduce: tensor is on meta; .* CPU and on CUDA"):
        dist.all_reduce(torch.ones(2, device="meta"))


def test_a_root_outside_the_group_is_named(world_of_one):
    with pytest.raises(InvalidRank, match=r"rank 0: broadcast: src=3 is outside the group"):
        dist.broadcast(torch.ones(2), src=3)


def test_a_list_of_several_tensors_per_process_is_refused(world_of_one):
    with pytest.raises(InvalidArgument, match=r"takes one tensor per process, got 2"):
        world_of_one.allreduce([torch.ones(2), torch.ones(2)])


def test_the_short_call_forms_check_their_arguments(world_of_one):
    x = torch.ones(2)
    world_of_one.allreduce(x, dist.ReduceOp.SUM).wait()  # DDP's process_group.allreduce(tensor)
    world_of_one.broadcast(x, 0).wait()
    with pytest.raises(InvalidArgument, match=r"expected a torch\.distributed\.ReduceOp, not 'sum'"):
        world_of_one.allreduce(x, "sum")
    with pytest.raises(InvalidArgument, match="expected options or a root rank, not True"):
        world_of_one.broadcast(x, True)


@pytest.mark.parametrize(("value", "chosen"), [("", "auto"), ("tcp", "tcp"), ("SHM", "shm"), ("mpi", "mpi")])
def test_the_transport_is_chosen_from_the_environment(monkeypatch, value, chosen):
    monkeypatch.setenv("FERRODIST_TORCH_TRANSPORT", value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if chosen == "auto":
        assert choose_transport(1) == "tcp"  # one rank: nothing to share memory with
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert choose_transport(2) == "shm"  # the launcher says every rank is on this host
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert choose_transport(2) == "tcp"
    else:
        assert choose_transport(2) == chosen


def test_a_misspelt_transport_is_named_with_the_choices(monkeypatch):
    monkeypatch.setenv("FERRODIST_TORCH_TRANSPORT", "sharedmem")
    with pytest.raises(InvalidArgument, match=r"'sharedmem' is not one of auto, shm, tcp, mpi \(group 3\)"):
        choose_transport(2, "3")


# -- two ranks (threads) -------------------------------------------------------------------------------


def test_collectives_and_futures_on_two_ranks():
    def body(group: FerrodistProcessGroup) -> Any:
        me = group.rank()
        x = torch.full((5,), float(me + 1))
        group.allreduce([x]).wait()
        futures = [group.allreduce([torch.full((3,), float(k + me))]).get_future() for k in range(4)]
        sums = [f.wait()[0].tolist() for f in futures]
        chained = group.allreduce([torch.ones(2)]).get_future().then(lambda f: f.value()[0] * 10)
        gathered = [torch.zeros(2) for _ in range(2)]
        group.allgather([gathered], [torch.full((2,), float(me))]).wait()
        return x.tolist(), sums, chained.wait().tolist(), [g.tolist() for g in gathered]

    results = torch_world(2, body)
    for result in results:
        assert not isinstance(result, BaseException), result
        x, sums, chained, gathered = result
        assert x == [3.0] * 5
        assert sums == [[float(2 * k + 1)] * 3 for k in range(4)]
        assert chained == [20.0, 20.0]
        assert gathered == [[0.0, 0.0], [1.0, 1.0]]


def test_a_failed_call_fails_its_future_where_torchs_cpp_code_looks():
    """DDP's reducer reads a future's error in C++. A future whose exception was only set
    from Python (``Future.set_exception``) looks successful there, with the exception as
    its value: the reducer took it for tensors and crashed (SIGSEGV). ``collect_all`` is
    C++ too and sees what the reducer sees."""

    def body(group: FerrodistProcessGroup) -> Any:
        me = group.rank()
        work = group.allreduce([torch.ones(10 if me == 0 else 20)])  # sizes disagree
        future = work.get_future()
        seen: dict[str, Any] = {}
        try:
            torch._C._collect_all([future]).wait()
        except RuntimeError as exc:
            seen["cpp"] = str(exc)
        try:
            future.wait()
        except RuntimeError as exc:
            seen["python"] = str(exc)
        try:
            work.wait()
        except FerrodistError as exc:
            seen["work"] = exc
        return seen

    for rank, seen in enumerate(torch_world(2, body)):
        assert not isinstance(seen, BaseException), seen
        assert "CollectiveMismatch" in seen.get("cpp", ""), seen
        assert f"rank {rank}: all_reduce #0 on group torch:test" in seen["python"], seen
        assert "CollectiveMismatch: " in seen["python"]
        assert isinstance(seen["work"], CollectiveMismatch)  # Work.wait raises ferrodist's own class
        assert seen["work"].peer == 1 - rank


def test_send_and_recv_with_futures_on_two_ranks():
    def body(group: FerrodistProcessGroup) -> Any:
        me, other = group.rank(), 1 - group.rank()
        got = torch.zeros(3)
        recv = group.recv([got], other, 7)
        send = group.send([torch.full((3,), float(me + 1))], other, 7)
        assert recv.get_future().wait()[0] is got
        send.wait()
        return got.tolist()

    assert torch_world(2, body) == [[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]]
