"""The "ferrodist" torch.distributed backend in this process: registration, a world of one
started through torch's stores, the errors a user meets, and torch groups over simulated
ranks (threads) for what needs two ranks: results, futures and failures as torch's C++
reads them (DDP's reducer does). Real processes under torchrun: test_torchrun.py.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytest.importorskip("ferrodist.torch", reason="ferrodist-torch is not installed (pip install packages/torch)")
from torch._C import _distributed_c10d as c10d  # noqa: E402

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


def test_public_names_resolve_on_first_use():
    """The agreed set is in tests/test_public_api.py; here each lazily imported name resolves."""
    for name in ferrodist.torch.__all__:
        assert getattr(ferrodist.torch, name) is not None, name
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


@pytest.mark.parametrize(
    ("value", "chosen"), [("", "auto"), ("tcp", "tcp"), ("SHM", "shm"), ("mpi", "mpi"), ("levels", "levels")]
)
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
        assert choose_transport(2) == "levels"  # two hosts of one rank each: the levels stay flat
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert choose_transport(4) == "levels"  # the launcher says the ranks span hosts
        assert choose_transport(2, "3") == "tcp"  # a group of some of them starts plain tcp
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        assert choose_transport(4) == "tcp"  # nothing says where the ranks run
    else:
        assert choose_transport(2) == chosen


def test_a_misspelt_transport_is_named_with_the_choices(monkeypatch):
    monkeypatch.setenv("FERRODIST_TORCH_TRANSPORT", "sharedmem")
    with pytest.raises(InvalidArgument, match=r"'sharedmem' is not one of auto, shm, tcp, levels, mpi \(group 3\)"):
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


def test_blocking_calls_on_cpu_tensors_go_straight_to_the_group(monkeypatch):
    """torch.distributed's blocking all_reduce and broadcast of a contiguous CPU tensor make
    no staging and use no worker; the other forms (async, a strided view, an op ferrodist
    lacks) still take the general path, with its results and errors."""
    from ferrodist.torch import _group

    made = []
    real = _group.Staging

    def counted(*args: Any) -> Any:
        made.append(threading.get_ident())  # each rank is a thread: count its own
        return real(*args)

    monkeypatch.setattr(_group, "Staging", counted)

    def body(group: FerrodistProcessGroup) -> Any:
        me = group.rank()
        x = torch.full((5,), float(me + 1))
        blocking = c10d.AllreduceOptions()
        blocking.asyncOp = False
        blocking.reduceOp = dist.ReduceOp.MAX
        work = group.allreduce([x], blocking)
        root = c10d.BroadcastOptions()
        root.asyncOp, root.rootRank = False, 1
        y = torch.full((3,), float(me))
        group.broadcast([y], root)
        fast = (x.tolist(), y.tolist(), work.is_completed(), work.result()[0] is x, made.count(threading.get_ident()))
        strided = torch.full((4, 2), float(me + 1)).t()  # not contiguous: staged, copied back
        group.allreduce([strided], c10d.AllreduceOptions()).wait()
        premul = c10d.AllreduceOptions()
        premul.asyncOp = False
        premul.reduceOp = dist._make_nccl_premul_sum(2.0)
        try:
            group.allreduce([x], premul)
            refused = None
        except InvalidArgument as exc:
            refused = str(exc)
        return fast, strided.tolist(), group.ferrodist_group._runner._worker is not None, refused

    for result in torch_world(2, body):
        assert not isinstance(result, BaseException), result
        fast, strided, worker, refused = result
        assert fast == ([2.0] * 5, [1.0] * 3, True, True, 0)  # no staging for the blocking pair
        assert strided == [[3.0] * 4] * 2
        assert worker  # the async one ran on the worker
        assert refused is not None and "PREMUL_SUM is not supported" in refused


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


# -- all_gather_coalesced: torch's output_tensor_lists[rank][i] -------------------------------------


def _value(rank: int, i: int) -> float:
    """A value that tells (rank, input) apart: rank 1's input 2 is 12."""
    return 10.0 * rank + i


@pytest.mark.parametrize(
    ("size", "count", "alike"), [(2, 2, True), (3, 3, True), (2, 2, False), (2, 3, False), (3, 1, False)]
)
def test_all_gather_coalesced_fills_one_list_per_rank(size, count, alike):
    """``output_tensor_lists[r][i]`` receives rank r's input i. With as many inputs as ranks,
    all of one shape (``alike``), reading the lists the other way round (``[i][r]``)
    passes every check and returns the transpose; the values tell (rank, input) apart."""

    def shape(i: int) -> tuple[int, ...]:
        return (2,) if alike else (i + 1, 2)

    def body(group: FerrodistProcessGroup) -> Any:
        me = group.rank()
        inputs = [torch.full(shape(i), _value(me, i)) for i in range(count)]
        outputs = [[torch.full(shape(i), -1.0) for i in range(count)] for _ in range(size)]
        group.allgather_coalesced(outputs, inputs).wait()
        return [[t.tolist() for t in per_rank] for per_rank in outputs]

    expected = [[torch.full(shape(i), _value(r, i)).tolist() for i in range(count)] for r in range(size)]
    for result in torch_world(size, body):
        assert not isinstance(result, BaseException), result
        assert result == expected


def test_all_gather_coalesced_asynchronously_with_a_future():
    def body(group: FerrodistProcessGroup) -> Any:
        me = group.rank()
        inputs = [torch.full((3,), _value(me, 0)), torch.full((1,), _value(me, 1))]
        outputs = [[torch.zeros(3), torch.zeros(1)] for _ in range(2)]
        opts = dist.distributed_c10d.AllgatherOptions()
        opts.asyncOp = True
        values = group.allgather_coalesced(outputs, inputs, opts).get_future().wait()
        return [t.tolist() for t in values]

    for result in torch_world(2, body):
        assert result == [[0.0] * 3, [1.0], [10.0] * 3, [11.0]]  # rank 0's inputs, then rank 1's


def test_all_gather_coalesced_names_a_layout_that_is_not_one_list_per_rank():
    def body(group: FerrodistProcessGroup) -> Any:
        inputs = [torch.ones(2), torch.ones(3), torch.ones(1)]
        with pytest.raises(InvalidArgument, match=r"output_tensor_lists has 3 lists but the group has 2 ranks"):
            group.allgather_coalesced([[torch.zeros(2), torch.zeros(2)] for _ in inputs], inputs)
        with pytest.raises(InvalidArgument, match=r"output_tensor_lists\[1\] has 2 tensors for 3 inputs"):
            group.allgather_coalesced([[torch.zeros(2), torch.zeros(3), torch.zeros(1)], [torch.zeros(2)] * 2], inputs)
        out = [torch.zeros(1), torch.zeros(1)]
        group.allgather([out], [torch.full((1,), float(group.rank()))]).wait()  # nothing was sent
        return [t.item() for t in out]

    assert torch_world(2, body) == [[0.0, 1.0], [0.0, 1.0]]


# -- recv from any source ------------------------------------------------------------------------------


def test_recv_from_any_source_in_a_group_of_two_says_who_sent():
    def body(group: FerrodistProcessGroup) -> Any:
        me = group.rank()
        if me == 1:
            group.send([torch.full((3,), 7.0)], 0, 5).wait()
            return None
        got = torch.zeros(3)
        work = group.recv_anysource([got], 5)
        work.wait()
        return work._source_rank(), work.source_rank(), got.tolist()

    assert torch_world(2, body)[0] == (1, 1, [7.0, 7.0, 7.0])


def test_recv_from_any_source_in_a_larger_group_takes_each_message_once_and_says_who_sent():
    def body(group: FerrodistProcessGroup) -> Any:
        me = group.rank()
        if me != 0:
            for i in range(2):
                group.send([torch.tensor([float(me), float(i)])], 0, 3).wait()
            return None
        seen = []
        for _ in range(6):
            got = torch.zeros(2)
            work = group.recv_anysource([got], 3)
            work.wait()
            assert got[0].item() == work._source_rank()
            seen.append((work._source_rank(), int(got[1].item())))
        return seen

    seen = torch_world(4, body)[0]
    for sender in (1, 2, 3):
        assert [i for s, i in seen if s == sender] == [0, 1]


# -- sparse all_reduce -----------------------------------------------------------------------------------


def _sparse(rank: int, shape: tuple[int, ...], dense: int = 0) -> Any:
    """Rank r's sparse COO tensor: entries at rows 0..r (duplicates included, uncoalesced),
    values that tell ranks apart."""
    rows = torch.tensor([[*range(rank + 1), 0]])
    sparse_dims = len(shape) - dense
    index = torch.cat([rows, *[torch.zeros(1, rank + 2, dtype=torch.long)] * (sparse_dims - 1)])
    values = (
        torch.arange(1.0, rank + 3).reshape(-1, *([1] * dense))
        * (rank + 1)
        * torch.ones(rank + 2, *shape[sparse_dims:])
    )
    return torch.sparse_coo_tensor(index, values, shape, check_invariants=True)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(("shape", "dense"), [((4,), 0), ((4, 3), 0), ((4, 2, 2), 1), ((5, 2), 1)])
def test_sparse_all_reduce_sums_every_ranks_entries(size, shape, dense):
    def body(group: FerrodistProcessGroup) -> Any:
        x = _sparse(group.rank(), shape, dense)
        group.allreduce([x]).wait()
        return x

    expected = sum(_sparse(r, shape, dense).to_dense() for r in range(size))
    results = torch_world(size, body)
    for result in results:
        assert not isinstance(result, BaseException), result
        assert result.layout == torch.sparse_coo and result.is_coalesced()
        assert torch.equal(result.to_dense(), expected)
        assert torch.equal(result.indices(), results[0].indices())
        assert torch.equal(result.values(), results[0].values())  # the same bits on every rank


def test_sparse_all_reduce_of_empty_tensors_and_through_torchs_call(world_of_one):
    x = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0), (3,), check_invariants=True)
    dist.all_reduce(x)
    assert x._nnz() == 0 and x.shape == (3,)
    y = _sparse(2, (4, 2))
    dist.all_reduce(y, async_op=True).wait()
    assert torch.equal(y.to_dense(), _sparse(2, (4, 2)).to_dense())


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_sparse_tensors_are_refused_clearly_where_they_are_not_reduced_with_sum():
    def body(group: FerrodistProcessGroup) -> Any:
        x = _sparse(group.rank(), (4,))
        with pytest.raises(
            InvalidArgument, match=r"sparse COO tensor is reduced with SUM only .* not MAX; use \.to_dense"
        ):
            group.allreduce([x], dist.ReduceOp.MAX)
        with pytest.raises(
            InvalidArgument, match=r"rank \d: broadcast: tensor has layout torch.sparse_coo; .*to_dense"
        ):
            group.broadcast([x], 0)
        csr = torch.eye(3).to_sparse_csr()
        with pytest.raises(InvalidArgument, match=r"layout torch.sparse_csr; .* \.to_sparse_coo\(\) for all_reduce"):
            group.allreduce([csr])
        different = _sparse(0, (4,) if group.rank() == 0 else (5,))
        with pytest.raises(InvalidArgument, match=r"the ranks' sparse tensors differ \(rank 0: float32 \(4,\), "):
            group.allreduce([different])
        group.allreduce([x]).wait()  # the group goes on
        return x.to_dense().tolist()

    expected = (_sparse(0, (4,)).to_dense() + _sparse(1, (4,)).to_dense()).tolist()
    assert torch_world(2, body) == [expected, expected]


# -- registration without importing ferrodist.torch ----------------------------------------------------------


def test_torch_registers_the_backend_itself_when_it_is_imported(tmp_path):
    """torch calls its ``torch.backends`` entry points at the end of ``import torch``:
    ferrodist-torch's registers "ferrodist" there, importing nothing of ferrodist's
    collectives until a group is made."""
    points = [p for p in importlib.metadata.entry_points(group="torch.backends") if p.name == "ferrodist"]
    assert points, "ferrodist-torch is installed without its torch.backends entry point: pip install -e packages/torch"
    script = """
import sys
import torch, torch.distributed as dist
assert "ferrodist" in dist.Backend.backend_list
assert "ferrodist.collectives" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ferrodist"))
dist.init_process_group("ferrodist", init_method=sys.argv[1], rank=0, world_size=1)
x = torch.arange(3.0)
dist.all_reduce(x)
print(dist.get_backend(), type(dist.group.WORLD).__name__, x.tolist())
dist.destroy_process_group()
"""
    run = [sys.executable, "-c", script, f"file://{tmp_path / 'store'}"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ferrodist", "FerrodistProcessGroup", "[0.0,", "1.0,", "2.0]"]
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # torch's switch: then only the import registers
    off = "import torch.distributed as d; print('ferrodist' in d.Backend.backend_list)"
    done = subprocess.run([sys.executable, "-c", off], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.strip() == "False", done.stderr


def test_importing_the_package_is_light_and_its_classes_load_on_first_use():
    script = (
        "import sys, ferrodist.torch as ft; light = 'ferrodist.collectives' not in sys.modules; "
        "print(light, ft.FerrodistProcessGroup.__name__, ft.TRANSPORTS[0], 'ferrodist.collectives' in sys.modules)"
    )
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.split() == ["True", "FerrodistProcessGroup", "auto", "True"], done.stderr
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        ferrodist.torch.Nope  # noqa: B018
