"""Run by tests/integration/test_real_processes.py as `ferrodist run -n N any_source.py BACKEND`
(or under mpiexec with ``mpi``): receives without a sender between real processes.

1. A work queue: every rank but 0 sends it ROUNDS results of different sizes at random
   moments; rank 0 takes them from whichever rank sends first, each exactly once and each
   sender's in the order sent.
2. Torch's pattern: each rank in turn receives from any rank while all the others send to
   it, through ``recv`` and ``irecv``.
3. A receive from any rank posted before one that names the sender takes the first message.

Prints ``rank R of N: any-source passed over BACKEND``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ferrodist.collectives as dist

ROUNDS = 20


def work_queue(rank: int, size: int) -> None:
    rng = np.random.default_rng(rank)
    if rank:
        for i in range(ROUNDS):
            time.sleep(float(rng.uniform(0, 0.002)))
            dist.send(np.full(4, rank * 1000 + i, np.int64), dst=0, tag=1)
        return
    seen: dict[int, list[int]] = {r: [] for r in range(1, size)}
    for _ in range(ROUNDS * (size - 1)):
        got = np.full(4, -1, np.int64)
        sender = dist.recv(got, tag=1)
        assert (got == got[0]).all() and got[0] // 1000 == sender, (sender, got)
        seen[sender].append(int(got[0] % 1000))
    assert seen == {r: list(range(ROUNDS)) for r in range(1, size)}, seen


def each_in_turn(rank: int, size: int) -> None:
    for receiver in range(size):
        if rank != receiver:
            dist.send(np.full(10, float(rank)), dst=receiver)
            dist.send(np.full(10, float(rank)), dst=receiver)
            continue
        senders = []
        for _ in range(size - 1):
            got = np.full(10, -1.0)
            senders.append(dist.recv(got))
            assert (got == senders[-1]).all()
            work = dist.irecv(got)
            work.wait()
            senders.append(work.source)
            assert (got == senders[-1]).all()
        assert sorted(senders) == sorted(r for r in range(size) if r != rank for _ in range(2)), senders
    dist.barrier()


def posted_first_takes_first(rank: int, size: int) -> None:
    anyone, named = np.zeros(1), np.zeros(1)
    if rank == 0:
        first = dist.irecv(anyone, tag=3)
        second = dist.irecv(named, src=size - 1, tag=3)
    dist.barrier()
    if rank == size - 1:
        dist.send(np.array([1.0]), dst=0, tag=3)
        dist.send(np.array([2.0]), dst=0, tag=3)
    if rank == 0:
        first.wait()
        second.wait()
        assert (first.source, anyone[0], named[0]) == (size - 1, 1.0, 2.0)
    dist.barrier()


def main() -> None:
    backend = sys.argv[1]
    world = dist.init_process_group(backend, timeout=60)
    work_queue(world.rank, world.size)
    dist.barrier()
    each_in_turn(world.rank, world.size)
    posted_first_takes_first(world.rank, world.size)
    print(f"rank {world.rank} of {world.size}: any-source passed over {backend}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
