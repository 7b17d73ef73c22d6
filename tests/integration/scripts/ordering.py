"""Run by tests/integration/test_ordering.py as `ferrodist run -n N ordering.py MODE BACKEND [ROUNDS]`.

MODE groups: two threads per rank, each running ROUNDS all_reduces on its own
             ``new_group`` over every rank (same dtype and size, different values).
MODE async:  the gradient-overlap pattern on the world group: an ``async_op=True``
             all_reduce, a blocking one while it is in flight, then ``wait()``.
MODE mixed:  async all_reduces, broadcasts and all_gathers of several sizes (small,
             one slot, many chunks) queued back to back, with blocking calls between.

Every result is compared with what it must be; a rank prints ``ok MODE CHECKED`` when
all were right, or ``wrong ...`` for the first wrong one and exits 1.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

import ferrodist.collectives as dist


def expect(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if not np.array_equal(got, want):
        print(f"wrong {what}: got {got[:4]} ... want {want[:4]} ...", flush=True)
        sys.exit(1)


def run_groups(rounds: int) -> int:
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(), dist.new_group()]
    failures: list[BaseException] = []

    def worker(which: int) -> None:
        try:
            group = groups[which]
            for i in range(rounds):
                x = np.full(1000, float(rank + 1 + 1000 * which + 10 * i), np.float32)
                dist.all_reduce(x, group=group)
                want = sum(r + 1 + 1000 * which + 10 * i for r in range(size))
                expect(x, np.full(1000, want, np.float32), f"group {which} round {i}")
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if failures:
        raise failures[0]
    return 2 * rounds


def run_async(rounds: int) -> int:
    rank, size = dist.get_rank(), dist.get_world_size()
    total = sum(r + 1 for r in range(size))
    for i in range(rounds):
        n = (100, 5000, 300_000)[i % 3]
        a = np.full(n, float(rank + 1 + i), np.float32)
        b = np.full(n, float(2 * (rank + 1) + i), np.float32)
        work = dist.all_reduce(a, async_op=True)
        dist.all_reduce(b)
        work.wait()
        expect(a, np.full(n, total + size * i, np.float32), f"async round {i}")
        expect(b, np.full(n, 2 * total + size * i, np.float32), f"blocking round {i}")
    return 2 * rounds


def run_mixed(rounds: int) -> int:
    rank, size = dist.get_rank(), dist.get_world_size()
    checked = 0
    for i in range(rounds):
        pending = []
        for j, n in enumerate((10, 4000, 200_000)):
            x = np.full(n, float(rank * 7 + i + j), np.float64)
            pending.append(("all_reduce", x, dist.all_reduce(x, async_op=True), n, i, j))
            y = np.full(n, float(rank), np.float64) if rank == j % size else np.zeros(n)
            pending.append(("broadcast", y, dist.broadcast(y, src=j % size, async_op=True), n, i, j))
            out = np.empty(size * n)
            pending.append(
                ("all_gather", out, dist.all_gather(out, np.full(n, float(rank + j)), async_op=True), n, i, j)
            )
        z = np.full(7, float(rank + i))
        dist.all_reduce(z, op="max")
        expect(z, np.full(7, float(size - 1 + i)), f"blocking max round {i}")
        checked += 1
        for kind, buf, work, n, i_, j in pending:
            work.wait()
            if kind == "all_reduce":
                want = np.full(n, float(sum(r * 7 + i_ + j for r in range(size))))
            elif kind == "broadcast":
                want = np.full(n, float(j % size))
            else:
                want = np.concatenate([np.full(n, float(r + j)) for r in range(size)])
            expect(buf, want, f"{kind} n={n} round {i_}")
            checked += 1
    return checked


def main() -> None:
    mode, backend = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    dist.init_process_group(backend, timeout=60)
    checked = {"groups": run_groups, "async": run_async, "mixed": run_mixed}[mode](rounds)
    print(f"ok {mode} {checked}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
