"""The torch.distributed-shaped API: process group lifetime, rank translation, async work,
timeouts that name who is missing, mismatches, and recovery after a failed call."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest

import ferrodist.collectives as dist
from ferrodist.core import (
    CollectiveMismatch,
    CollectiveTimeout,
    Group,
    GroupAborted,
    InvalidArgument,
    InvalidRank,
    NotInitialized,
    PeerLost,
    ReduceOp,
)
from ferrodist.core.kernels import wait_for_compiles
from ferrodist.testing import run_world
from ferrodist.transport import SimulatedTransport


def test_single_process_world_without_a_launcher():
    world = dist.init_process_group("simulated")
    try:
        assert (dist.get_rank(), dist.get_world_size(), dist.is_initialized()) == (0, 1, True)
        x = np.array([1.0, 2.0])
        dist.all_reduce(x, ReduceOp.AVG)
        np.testing.assert_array_equal(x, [1.0, 2.0])
        assert isinstance(world, Group)
        seen = []
        worker = threading.Thread(target=lambda: seen.append(dist.get_world_size()))
        worker.start()
        worker.join(5)
        assert seen == [1]  # the process's default group, visible from any thread
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_using_the_default_group_before_init_is_a_clear_error():
    with pytest.raises(NotInitialized, match="init_process_group"):
        dist.all_reduce(np.zeros(1))
    with pytest.raises(NotInitialized):
        dist.get_rank()
    with pytest.raises(NotInitialized):
        dist.destroy_process_group()


def test_init_errors():
    with pytest.raises(InvalidArgument, match="run_world"):
        dist.init_process_group("simulated", rank=0, world_size=4)
    with pytest.raises(
        InvalidArgument, match="backend='nccl' sends CUDA tensors through NCCL, but cuda_route='staged'"
    ):
        dist.init_process_group("nccl", cuda_route="staged")
    with pytest.raises(InvalidArgument, match="cuda_route='fast' is not a CUDA route; use one of auto, nccl, staged"):
        dist.init_process_group("simulated", cuda_route="fast")
    with pytest.raises(InvalidArgument, match="MASTER_ADDR, MASTER_PORT not set; start the ranks with `ferrodist run"):
        dist.init_process_group("tcp", rank=0, world_size=2)
    with pytest.raises(InvalidArgument, match="tcp://HOST:PORT"):
        dist.init_process_group("tcp", init_method="file:///tmp/x", rank=0, world_size=2)
    with pytest.raises(InvalidArgument, match="unknown backend"):
        dist.init_process_group("carrier-pigeon")
    with pytest.raises(InvalidArgument, match="timeout"):
        dist.init_process_group("simulated", timeout=0)
    t0, _ = SimulatedTransport.create_group(2)
    with pytest.raises(InvalidRank):
        dist.init_process_group(transport=t0, rank=1)
    dist.init_process_group("simulated")
    try:
        with pytest.raises(InvalidArgument, match="already initialized"):
            dist.init_process_group("simulated")
        # Checked before any transport is built: no port is bound, no peer waited for.
        start = time.monotonic()
        for backend in ("tcp", "shm", "mpi"):
            with pytest.raises(InvalidArgument, match=r"rank 0: init_process_group: .* already initialized"):
                dist.init_process_group(backend, init_method="tcp://127.0.0.1:9", rank=1, world_size=2)
        assert time.monotonic() - start < 0.5
    finally:
        dist.destroy_process_group()


def test_each_simulated_rank_has_its_own_default_group():
    def rank_main():
        return (dist.get_rank(), dist.get_world_size())

    assert run_world(4, rank_main) == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_module_functions_take_global_ranks_and_methods_group_ranks():
    def rank_main():
        me = dist.get_rank()
        group = dist.new_group([1, 3])
        if not group.is_member:
            with pytest.raises(InvalidRank, match="not a member"):
                group.rank  # noqa: B018
            with pytest.raises(InvalidRank, match="not a member"):
                dist.all_reduce(np.zeros(1), group=group)
            return None
        assert dist.get_rank(group) == group.rank == {1: 0, 3: 1}[me]
        x = np.array([float(me)])
        dist.broadcast(x, src=3, group=group)  # global rank 3
        y = np.array([float(me)])
        group.broadcast(y, src=0)  # group rank 0 = global rank 1
        with pytest.raises(InvalidRank, match="not in group"):
            dist.broadcast(x, src=0, group=group)
        return (x[0], y[0])

    assert run_world(4, rank_main) == [None, (3.0, 1.0), None, (3.0, 1.0)]


@pytest.mark.parametrize("ranks", [[0, 0], [], [0, 9], ["a"]])
def test_new_group_rejects_bad_rank_lists(ranks):
    def rank_main():
        with pytest.raises(InvalidArgument):
            dist.new_group(ranks)

    run_world(2, rank_main)


def test_in_place_result_is_visible_in_the_callers_array():
    def rank_main():
        x = np.arange(6, dtype=np.int32).reshape(2, 3) * (dist.get_rank() + 1)
        view_holder = x
        dist.all_reduce(x)
        return view_holder

    for out in run_world(3, rank_main):
        np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3) * 6)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_float_sums_are_bit_identical_across_ranks_whatever_the_order(algorithm):
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(1001).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 4)) for _ in range(7)]

    def rank_main():
        x = inputs[dist.get_rank()].copy()
        dist.all_reduce(x, algorithm=algorithm)
        return x.tobytes()

    results = run_world(7, rank_main)
    assert len(set(results)) == 1


def test_async_work_completes_in_issue_order_and_reports_errors():
    def rank_main():
        me = dist.get_rank()
        a = np.full(4, me + 1.0)
        b = np.full(4, 10.0 * (me + 1))
        w1 = dist.all_reduce(a, async_op=True)
        w2 = dist.broadcast(b, src=1, async_op=True)
        c = np.array([me])
        dist.all_reduce(c)  # a blocking call in between
        w1.wait(10)
        w2.wait(10)
        assert w1.is_completed() and w2.is_success()
        return a[0], b[0], c[0]

    assert run_world(3, rank_main) == [(6.0, 20.0, 3)] * 3


def test_wait_with_a_short_timeout_raises_but_the_work_keeps_going():
    def rank_main():
        me = dist.get_rank()
        x = np.ones(3)
        if me == 1:
            time.sleep(0.3)
        work = dist.all_reduce(x, async_op=True)
        if me == 0:
            with pytest.raises(CollectiveTimeout, match="still running"):
                work.wait(0.01)
        work.wait(10)
        return x[0]

    assert run_world(2, rank_main) == [2.0, 2.0]


def test_point_to_point_with_tags():
    def rank_main():
        me = dist.get_rank()
        if me == 0:
            dist.send(np.array([1.0]), dst=1, tag=2)
            work = dist.isend(np.array([2.0]), dst=1, tag=1)
            work.wait(5)
            return None
        first, second = np.zeros(1), np.zeros(1)
        w = dist.irecv(first, src=0, tag=1)
        dist.recv(second, src=0, tag=2, timeout=5)
        w.wait(5)
        return first[0], second[0]

    assert run_world(2, rank_main)[1] == (2.0, 1.0)


def test_a_rank_that_skips_a_collective_is_named_in_the_timeout():
    def rank_main():
        me = dist.get_rank()
        if me == 2:
            time.sleep(1.5)  # never calls all_reduce, but stays alive past the others' timeout
            return None
        if me == 1:
            time.sleep(0.1)  # rank 0 times out first; rank 1 may then see rank 0 leave
        try:
            dist.all_reduce(np.ones(4), timeout=0.5, algorithm="ring")
        except (CollectiveTimeout, PeerLost) as exc:
            return exc
        return None

    results = run_world(3, rank_main)
    # On the ring 0 -> 1 -> 2 -> 0, rank 0 receives from rank 2: it must name rank 2.
    first = results[0]
    assert isinstance(first, CollectiveTimeout)
    assert first.waiting_for == (2,) and first.operation == "all_reduce" and first.rank == 0
    assert str(first).startswith("rank 0: all_reduce #0 on group world")
    assert "from rank 2" in str(first)
    assert isinstance(results[1], (CollectiveTimeout, PeerLost))


def test_ranks_calling_different_collectives_are_told_at_once_what_each_called():
    def rank_main():
        x = np.ones(2)
        start = time.monotonic()
        try:
            if dist.get_rank() == 0:
                dist.all_reduce(x, timeout=5)
            else:
                dist.reduce(x, dst=1, timeout=5)
        except (CollectiveMismatch, PeerLost) as exc:
            return exc, x.tolist(), time.monotonic() - start
        return None, x.tolist(), 0.0

    (err0, x0, _), (err1, x1, took1) = run_world(2, rank_main)
    # Rank 1 (the reduce root) receives rank 0's all_reduce message and sees the mismatch.
    assert isinstance(err1, CollectiveMismatch) and took1 < 2
    assert err1.peer == 0
    assert "rank 0 is in all_reduce(float64 x 2, op=SUM) while this rank is in reduce(float64 x 2, op=SUM, root=1)" in (
        str(err1)
    )
    # Rank 0 is told at once too: by rank 1's message (a reduce first checks that the
    # neighbours are in the same call) or by rank 1's abort notice.
    assert isinstance(err0, CollectiveMismatch) and err0.peer == 1
    assert x0 == x1 == [1.0, 1.0]  # nobody's data was touched


def test_different_sizes_across_ranks_are_a_mismatch():
    def rank_main():
        x = np.ones(4 + dist.get_rank())
        try:
            dist.all_reduce(x, timeout=1, algorithm="recursive_doubling")
        except (CollectiveMismatch, CollectiveTimeout) as exc:
            return type(exc).__name__
        return "no error"

    results = run_world(2, rank_main)
    assert "CollectiveMismatch" in results
    assert "no error" not in results


def test_a_failing_rank_makes_waiting_peers_fail_fast_with_its_rank():
    def rank_main():
        if dist.get_rank() == 1:
            raise RuntimeError("boom on purpose")
        dist.all_reduce(np.ones(2), timeout=30)

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom") as info:
        run_world(3, rank_main)
    assert time.monotonic() - start < 10
    assert any("rank 1" in note for note in getattr(info.value, "__notes__", []))


def test_bad_input_loses_nothing_but_a_failed_call_aborts_the_group_on_every_rank():
    def rank_main():
        with pytest.raises(InvalidArgument):  # refused before any byte moved: the group goes on
            dist.all_reduce(np.zeros(2, np.float32), ReduceOp.BAND)
        x = np.array([1])
        dist.all_reduce(x)
        assert x[0] == 2
        if dist.get_rank() == 0:
            with pytest.raises(CollectiveTimeout):
                dist.barrier(timeout=0.2)  # rank 1 is late
        else:
            time.sleep(0.5)
            with pytest.raises(GroupAborted, match="rank 0 aborted the group"):
                dist.barrier(timeout=5)  # rank 0 gave this call up: it fails here too, at once
        started = time.monotonic()
        with pytest.raises(GroupAborted, match=r"aborted by the failure of its call #1") as caught:
            dist.all_reduce(x, timeout=5)  # later calls fail at once, naming the first failure
        assert time.monotonic() - started < 0.5
        assert isinstance(caught.value.cause, CollectiveTimeout)
        fresh = dist.new_group()  # a group made again works
        y = np.array([1])
        fresh.all_reduce(y)
        return y[0]

    assert run_world(2, rank_main) == [2, 2]


def test_scratch_buffers_are_reused_not_allocated_per_call():
    def rank_main():
        group = dist.new_group()
        x = np.ones(100_000, np.float32)
        group.all_reduce(x, algorithm="ring")
        buffers = dict(group._runner.scratch._local.buffers)
        for _ in range(3):
            group.all_reduce(x, algorithm="ring")
        assert group._runner.scratch._local.buffers == buffers
        assert all(group._runner.scratch._local.buffers[k] is v for k, v in buffers.items())

    run_world(3, rank_main)


def test_destroy_process_group_stops_the_async_worker():
    def rank_main():
        group = dist.new_group()
        group.all_reduce(np.ones(1), async_op=True).wait(5)
        worker = group._runner._worker
        dist.destroy_process_group(group)
        assert group._runner._worker is None and not worker._thread.is_alive()
        with pytest.raises(InvalidArgument, match="destroyed"):
            group.all_reduce(np.ones(1))

    run_world(2, rank_main)


def test_destroying_the_world_stops_the_workers_of_its_subgroups():
    def rank_main():
        sub = dist.new_group()
        sub.all_reduce(np.ones(1), async_op=True).wait(5)
        worker = sub._runner._worker
        dist.destroy_process_group()
        dist.init_process_group("simulated")  # run_world tears a group down afterwards
        return worker._thread.is_alive(), sub._runner._worker

    assert run_world(2, rank_main) == [(False, None)] * 2


def test_a_failed_async_call_reports_through_its_work():
    def rank_main():
        if dist.get_rank() == 1:
            time.sleep(1.0)  # never joins the all_reduce, but stays until rank 0 is done
            return None
        work = dist.all_reduce(np.ones(1), async_op=True, timeout=0.2)
        with pytest.raises(CollectiveTimeout, match=r"rank 0: all_reduce #0 on group world"):
            work.wait(5)
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), CollectiveTimeout)
        with pytest.raises(CollectiveTimeout):
            work.wait(0)  # the error stays with the work
        assert "failed" in repr(work)
        return None

    run_world(2, rank_main)


def test_torch_tensors_are_reduced_in_place():
    torch = pytest.importorskip("torch")

    def rank_main():
        t = torch.full((3,), float(dist.get_rank() + 1), dtype=torch.bfloat16)
        dist.all_reduce(t)
        g = torch.arange(4, dtype=torch.float32, requires_grad=True)
        dist.all_reduce(g)  # as_tensor detaches: the same memory, reduced in place
        return t.float().tolist(), g.detach().tolist()

    for values, grads in run_world(2, rank_main):
        assert values == [3.0, 3.0, 3.0]
        assert grads == [0.0, 2.0, 4.0, 6.0]


def test_threads_waiting_do_not_spin():
    # 8 ranks on 2 cores: ranks parked in a long wait must not burn CPU.
    def rank_main():
        if dist.get_rank() == 0:
            time.sleep(0.5)
        dist.barrier(timeout=10)

    assert wait_for_compiles(300)  # kernels earlier tests queued compile on this process's CPU too
    cpu_before = time.process_time()
    wall_before = time.monotonic()
    run_world(8, rank_main)
    cpu = time.process_time() - cpu_before
    wall = time.monotonic() - wall_before
    assert wall >= 0.5
    assert cpu < 0.5 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s: waits are spinning"


def test_peer_lost_is_raised_when_a_peer_closes_mid_collective():
    def rank_main():
        if dist.get_rank() == 0:
            time.sleep(0.2)
            dist.destroy_process_group()  # leaves: its transport closes
            dist.init_process_group("simulated")  # run_world expects a group to tear down
            return None
        with pytest.raises(PeerLost) as info:
            dist.all_reduce(np.ones(1), timeout=30)
        return info.value.peer

    assert run_world(2, rank_main)[1] == 0


def test_errors_name_rank_operation_and_call_number():
    def rank_main():
        dist.barrier()
        if dist.get_rank() == 0:
            with pytest.raises(CollectiveTimeout) as info:
                dist.all_reduce(np.ones(1), timeout=0.2)
            return str(info.value)
        time.sleep(0.6)
        return None

    message = run_world(2, rank_main)[0]
    assert message.startswith("rank 0: all_reduce #1 on group world (group rank 0 of 2)")
    assert "rank 1" in message


def test_concurrent_calls_on_two_groups_from_two_threads_do_not_mix():
    def rank_main():
        me = dist.get_rank()
        other = dist.new_group()  # same ranks, separate traffic
        side_result = {}

        def side():
            y = np.full(1000, 2.0 * (me + 1))
            for _ in range(5):
                other.all_reduce(y)
            side_result["y"] = y[0]

        thread = threading.Thread(target=side)
        thread.start()
        works = [dist.all_reduce(np.full(10, float(i)), async_op=True) for i in range(5)]
        x = np.full(10, me + 1.0)
        dist.all_reduce(x)
        for w in works:
            w.wait(10)
        thread.join(10)
        return x[0], side_result["y"]

    assert run_world(3, rank_main) == [(6.0, 12.0 * 3**4)] * 3


def test_debug_mode_reports_what_every_rank_called(monkeypatch):
    monkeypatch.setenv("FERRODIST_DEBUG", "detail")

    def rank_main():
        me = dist.get_rank()
        x = np.zeros((2, 3) if me != 2 else (3, 2), np.float32)  # same size, different shape
        with pytest.raises(CollectiveMismatch) as info:
            dist.all_reduce(x, timeout=10)
        return str(info.value)

    messages = run_world(3, rank_main)
    assert len({m.split("debug check: ", 1)[1] for m in messages}) == 1  # every rank says the same
    assert (
        "debug check: the ranks disagree about this call: ranks [0, 1] called all_reduce(float32 x 6, op=SUM) "
        "with shape (2, 3); rank 2 called all_reduce(float32 x 6, op=SUM) with shape (3, 2)"
    ) in messages[0]


def test_debug_mode_names_different_operations_on_every_rank(monkeypatch):
    monkeypatch.setenv("FERRODIST_DEBUG", "detail")

    def rank_main():
        x = np.ones(4)
        with pytest.raises(
            CollectiveMismatch, match=r"rank 1 called broadcast\(float64 x 4, root=0\) with shape \(4,\)"
        ):
            if dist.get_rank() == 1:
                dist.broadcast(x, src=0, timeout=10)
            else:
                dist.all_reduce(x, timeout=10)
        with pytest.raises(GroupAborted):
            dist.all_reduce(x, timeout=10)
        dist.new_group().all_reduce(x, timeout=10)
        return x[0]

    assert run_world(2, rank_main) == [2.0, 2.0]


def test_without_debug_mode_a_shape_difference_of_equal_size_goes_through():
    def rank_main():
        x = np.ones((2, 3) if dist.get_rank() == 0 else (3, 2))
        dist.all_reduce(x)
        return x.sum()

    assert run_world(2, rank_main) == [12.0, 12.0]


_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture
def launcher_env(monkeypatch):
    """No launcher variable, whatever the calling shell exported; set the test's own with it."""
    for name in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_auto_without_any_launcher_variable_is_a_world_of_one_and_says_so(launcher_env):
    """torch would refuse to start; a world of one is useful (a script tried alone), but a
    user who forgot the launcher is told, at the line that asked."""
    with pytest.warns(UserWarning, match=r"no launcher variables .* a world of one rank; start several with") as said:
        dist.init_process_group()
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert [w.filename for w in said] == [__file__]
    finally:
        dist.destroy_process_group()


def test_gloo_says_that_it_is_not_gloo_and_simulated_is_quiet(launcher_env):
    with pytest.warns(
        UserWarning, match=r"init_process_group\('gloo'\) runs over ferrodist's own 'simulated' transport"
    ):
        dist.init_process_group("gloo")
    dist.destroy_process_group()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist.init_process_group("simulated")  # a world of one, asked for
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["auto", "gloo", "tcp", "shm"])
@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29800"},
            "init_process_group: WORLD_SIZE is not set but RANK='1', MASTER_ADDR='127.0.0.1' and MASTER_PORT='29800' "
            "are",
        ),
        (
            {"WORLD_SIZE": "2"},
            "init_process_group: RANK, MASTER_ADDR and MASTER_PORT are not set but WORLD_SIZE='2' is",
        ),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29800"}, "init_process_group: RANK, WORLD_SIZE not set;"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "init_process_group: MASTER_ADDR, MASTER_PORT not set;"),
        ({"RANK": "abc"}, "init_process_group: environment variable RANK='abc' is not an integer"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "init_process_group: OMPI_COMM_WORLD_SIZE is not set but"),
    ],
)
def test_a_launcher_variable_without_the_others_is_an_error_naming_the_missing_ones(launcher_env, backend, env, said):
    """Never a simulated world of one, and never more or fewer names than are missing."""
    for name, value in env.items():
        launcher_env.setenv(name, value)
    start = time.monotonic()
    try:
        with pytest.raises(InvalidArgument) as raised:
            dist.init_process_group(backend, timeout=5)
    finally:
        if dist.is_initialized():  # a world nobody asked for: leave none for the next test
            dist.destroy_process_group()
    message = str(raised.value)
    assert message.startswith(said), message
    assert "start the ranks with" in message or "set it to a number" in message, message  # what to do
    assert time.monotonic() - start < 2  # said at once, not after waiting for peers
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend", ["simulated", "mpi"])
def test_backends_that_do_not_read_the_launcher_variables_ignore_a_partial_set(launcher_env, backend):
    launcher_env.setenv("WORLD_SIZE", "2")
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    dist.init_process_group(backend)
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["auto", "tcp"])
def test_master_address_in_the_environment_and_rank_and_size_as_arguments(launcher_env, backend):
    """torch.multiprocessing.spawn's pattern: each process sets MASTER_ADDR and MASTER_PORT
    and passes its rank and the world size to init_process_group."""
    from _helpers import free_port
    from ferrodist.transport import TcpTransport

    port = free_port()
    launcher_env.setenv("MASTER_ADDR", "127.0.0.1")
    launcher_env.setenv("MASTER_PORT", str(port))
    launcher_env.setenv("FERRODIST_TOKEN", "spawn-test")
    peer: list = []
    joiner = threading.Thread(
        target=lambda: peer.append(
            TcpTransport.connect(rank=1, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=30)
        )
    )
    joiner.start()
    try:
        dist.init_process_group(backend, rank=0, world_size=2, timeout=30)
        try:
            assert (dist.get_rank(), dist.get_world_size()) == (0, 2)
        finally:
            dist.destroy_process_group()
    finally:
        joiner.join(35)
        for transport in peer:
            transport.close()
