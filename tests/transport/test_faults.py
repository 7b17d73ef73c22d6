"""Injected faults in a simulated world: every failure path, deterministically, in one process."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ferrodist.collectives as dist
from ferrodist.core import CollectiveTimeout, InvalidArgument, PeerLost
from ferrodist.testing import run_world
from ferrodist.transport import Faults, SimulatedTransport


def ring_all_reduce():
    try:
        dist.all_reduce(np.ones(64), algorithm="ring", timeout=2)
    except (PeerLost, CollectiveTimeout) as exc:
        return exc
    return None


def test_a_rank_that_dies_mid_all_reduce_makes_everyone_fail_fast():
    # 4 ranks, ring: each rank sends 6 messages; rank 2 dies at its 3rd, mid reduce-scatter.
    start = time.monotonic()
    results = run_world(4, ring_all_reduce, faults=Faults(die_at={2: 3}))
    assert time.monotonic() - start < 2  # nobody waited for the 2 s timeout
    assert all(isinstance(r, PeerLost) for r in results), results
    assert "injected fault: this rank died at its message 3" in str(results[2])
    # Rank 3 receives from rank 2 in the ring: it names rank 2 as the rank it lost.
    assert results[3].peer == 2 and "rank 2" in str(results[3])


def test_a_silent_rank_makes_its_peers_time_out_with_every_rank_present():
    results = run_world(3, ring_all_reduce, faults=Faults(silent_at={1: 2}), timeout=5)
    assert all(isinstance(r, CollectiveTimeout) for r in results)
    # Every rank reached the call, so the census says a transfer inside it is stuck.
    assert all("every rank reached call #0" in str(r) for r in results)


def test_a_slow_rank_only_slows_things_down():
    start = time.monotonic()
    results = run_world(2, lambda: dist.all_reduce(x := np.ones(3)) or x[0], faults=Faults(delay={0: 0.1}))
    assert results == [2.0, 2.0]
    assert time.monotonic() - start >= 0.1


def test_a_rank_that_never_arrives_is_named_by_the_census():
    def rank_main():
        if dist.get_rank() == 2:
            time.sleep(2.5)
            return None
        return ring_all_reduce()

    results = run_world(3, rank_main, timeout=5)
    for rank in (0, 1):
        assert isinstance(results[rank], CollectiveTimeout)
        assert results[rank].waiting_for == (2,)
        assert "rank 2 never reached call #0 (it had made no call on this group yet)" in str(results[rank])


@pytest.mark.parametrize(
    "faults", [Faults(delay={5: 1.0}), Faults(die_at={0: 0}), Faults(silent_at={-1: 1}), Faults(delay={0: -1})]
)
def test_faults_are_checked(faults):
    with pytest.raises(InvalidArgument):
        SimulatedTransport.create_group(2, faults=faults)
