"""Run by tests/integration/test_levels.py on every rank of a job over two nodes (one
``ferrodist run`` per node): ``levels.py``.

Joins with ``init_process_group("auto")``, which must pick the two levels with shared
memory inside the node, runs every collective the levels run on sizes of both paths (one
leader per node, shards) and float32 / int64, checks each against the closed form, and
prints one line::

    levels ok backend=levels inner=ShmTransport arena=yes checks=67
"""

from __future__ import annotations

import numpy as np

import ferrodist.collectives as dist


def main() -> None:
    dist.init_process_group("auto", timeout=60)
    rank, size = dist.get_rank(), dist.get_world_size()
    levels = dist.default_group()._route.levels
    checks = 0
    for count in (3, 1000, 40_000, 300_001):
        for dtype in (np.float32, np.int64):
            base = np.arange(count) % 97
            x = (base + rank).astype(dtype)
            dist.all_reduce(x)
            assert np.array_equal(x, (size * base + size * (size - 1) // 2).astype(dtype)), "all_reduce"
            for root in (0, size - 1):
                y = (base + rank).astype(dtype)
                dist.broadcast(y, src=root)
                assert np.array_equal(y, (base + root).astype(dtype)), "broadcast"
                z = (base + rank).astype(dtype)
                dist.reduce(z, dst=root, op="max")
                assert np.array_equal(z, (base + (size - 1 if rank == root else rank)).astype(dtype)), "reduce"
            out = np.zeros(count * size, dtype)
            dist.all_gather(out, np.full(count, rank, dtype))
            assert np.array_equal(out, np.repeat(np.arange(size), count).astype(dtype)), "all_gather"
            mine = np.zeros(count, dtype)
            dist.reduce_scatter(mine, np.repeat(np.arange(size), count).astype(dtype) + rank)
            assert np.array_equal(mine, np.full(count, size * rank + size * (size - 1) // 2, dtype)), "reduce_scatter"
            dist.barrier()
            checks += 8
    for count in (5, 3000, 300_001):  # floats whose sums round: every rank must end with the same bits
        x = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
        dist.all_reduce(x)
        everyone = np.zeros(count * size, np.float32)
        dist.all_gather(everyone, x)
        assert all(np.array_equal(x, part) for part in everyone.reshape(size, count)), "the same bits"
        checks += 1
    inner = type(levels.inner).__name__ if levels is not None and levels.inner is not None else None
    arena = "yes" if levels is not None and levels.native is not None else "no"
    print(f"levels ok backend={dist.get_backend()} inner={inner} arena={arena} checks={checks}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
