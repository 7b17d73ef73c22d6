"""Failure semantics on in-process worlds: the order of a group's calls, aborts that stay in
their group, and blame that follows a rank held up by another group's failure."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import ferrodist.collectives as dist
from ferrodist.core import CollectiveTimeout, GroupAborted
from ferrodist.testing import run_world


def test_a_blocking_call_waits_for_the_async_calls_issued_before_it():
    def rank_main():
        rank = dist.get_rank()
        results = []
        for i in range(20):
            a = np.full(50_000, float(rank + i))
            b = np.full(7, float(10 * rank + i))
            work = dist.all_reduce(a, async_op=True, algorithm="ring")
            dist.all_reduce(b)  # issued second: it runs second on every rank
            work.wait(10)
            results.append((a[0], b[0]))
        return results

    for results in run_world(3, rank_main):
        assert results == [(3.0 + 3 * i, 30.0 + 3 * i) for i in range(20)]


def test_threads_on_their_own_groups_never_mix():
    def rank_main():
        rank, groups = dist.get_rank(), [dist.new_group(), dist.new_group()]
        wrong = []

        def work(which: int) -> None:
            for i in range(30):
                x = np.full(100, float(rank + 100 * which + i))
                groups[which].all_reduce(x)
                if x[0] != 1 + 200 * which + 2 * i:
                    wrong.append((which, i, x[0]))

        threads = [threading.Thread(target=work, args=(w,)) for w in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return wrong

    assert run_world(2, rank_main) == [[], []]


def test_an_aborted_subgroup_leaves_the_world_working():
    def rank_main():
        pair = dist.new_group([0, 1])
        if dist.get_rank() == 1:  # rank 1 calls barrier, rank 0 is late: the pair group aborts
            with pytest.raises(CollectiveTimeout, match="rank 0 never reached call #0"):
                pair.barrier(timeout=0.3)
        if dist.get_rank() == 0:
            time.sleep(0.5)
            with pytest.raises(GroupAborted, match="rank 1 aborted the group"):
                pair.barrier(timeout=2)
        if dist.get_rank() in (0, 1):
            with pytest.raises(GroupAborted):
                pair.all_reduce(np.ones(1))
        x = np.ones(3)
        dist.all_reduce(x, timeout=5)  # the world is untouched
        return x[0]

    assert run_world(3, rank_main) == [3.0, 3.0, 3.0]


def test_a_rank_held_up_by_another_groups_failure_passes_the_blame_on():
    def rank_main():
        rank = dist.get_rank()
        pair, other = dist.new_group([0, 1]), dist.new_group([0, 2])
        if rank == 2:
            time.sleep(3)  # never reaches its call on the other group in time
            return None
        if rank == 0:
            with pytest.raises(CollectiveTimeout, match="rank 2 never reached call #0"):
                other.all_reduce(np.ones(1), timeout=1.0)  # rank 2 is alive, between calls: it says so
            time.sleep(0.6)  # handling that failure, rank 0 is late for the pair's call
            with pytest.raises(GroupAborted):
                pair.all_reduce(np.ones(1), timeout=5)  # rank 1 gave it up meanwhile
            return None
        with pytest.raises(CollectiveTimeout) as caught:
            pair.all_reduce(np.ones(1), timeout=1.2)  # rank 0 is stuck in the other group's call
        return str(caught.value)

    message = run_world(3, rank_main, timeout=10)[1]
    assert "rank 0 was held up by an earlier failure there" in message
    assert "rank 2 never reached call #0" in message


@pytest.mark.parametrize("async_op", [False, True])
def test_an_error_from_other_code_inside_a_call_fails_the_call_on_every_rank(monkeypatch, async_op):
    """An exception that is not ferrodist's (a CUDA library's, a bug) raised inside rank 1's
    call aborts the group like ferrodist's own errors: rank 0, waiting in the same call,
    fails at once naming rank 1's error instead of waiting out its deadline (on an H100,
    a CUDA error in one rank's DDP bucket left the other waiting 30 s)."""
    from ferrodist.collectives._algorithms import doubling

    original = doubling.all_reduce

    def failing_on_rank_1(call, x, kernel, divisor):
        if call.ranks[call.rank] == 1:
            raise RuntimeError("cuCtxGetCurrent: CUDA_ERROR_NOT_INITIALIZED")
        original(call, x, kernel, divisor)

    monkeypatch.setattr(doubling, "all_reduce", failing_on_rank_1)

    def rank_main():
        x = np.ones(4)
        with pytest.raises(Exception) as caught:
            work = dist.all_reduce(x, async_op=async_op, algorithm="recursive_doubling", timeout=20)
            if work is not None:
                work.wait()
        with pytest.raises(GroupAborted):  # the group stays aborted
            dist.all_reduce(np.ones(2), algorithm="recursive_doubling")
        return caught.value

    errors = run_world(2, rank_main, timeout=20)
    assert all(not isinstance(e, CollectiveTimeout) for e in errors), errors
    assert all("RuntimeError: cuCtxGetCurrent: CUDA_ERROR_NOT_INITIALIZED" in str(e) for e in errors), errors
    assert isinstance(errors[1].__cause__, RuntimeError)  # the original stays reachable on its own rank


def test_a_group_aborted_before_a_ranks_first_call_says_so():
    """A peer's failure reaching a rank that has made no collective on the group yet is worded
    as such (it once read "after its call #-1"), and not as if the rank had made no call at
    all (a pipeline's stages make point-to-point calls only)."""

    def rank_main():
        if dist.get_rank() == 0:
            with pytest.raises(CollectiveTimeout):
                dist.all_reduce(np.ones(2), timeout=0.5)  # rank 1 is not there yet
            return ""
        time.sleep(1.5)
        with pytest.raises(GroupAborted) as caught:
            dist.all_reduce(np.ones(2))
        return str(caught.value)

    message = run_world(2, rank_main)[1]
    assert "#-1" not in message and "group world before its first collective there" in message, message


def test_a_timeout_names_the_missing_rank_before_the_healthy_peer_it_waited_on():
    """Rank 1 waits on rank 0, which is healthy and waiting itself; rank 3 never came. The
    message leads with rank 3 (what the census found), then says what rank 1 waited for."""

    def rank_main():
        if dist.get_rank() == 3:
            time.sleep(2.5)
            return ""
        with pytest.raises(CollectiveTimeout) as caught:
            dist.all_reduce(np.ones(300_000), timeout=1.0, algorithm="ring")
        return str(caught.value)

    message = run_world(4, rank_main, timeout=5)[1]
    found, waited = message.find("rank 3 never reached call #0"), message.find("waited")
    assert 0 <= found < waited, message
