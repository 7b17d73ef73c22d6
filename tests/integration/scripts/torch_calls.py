"""Run by tests/collectives/test_torch_calls.py as `ferrodist run -n N torch_calls.py BACKEND`
(or under mpiexec with BACKEND=mpi): every call ferrodist.collectives added for torch's
sake, once or a few times each, between real processes. Inputs come from a generator that
every rank seeds alike, so each rank knows every rank's input and checks its own result
against ferrodist.testing's references. Prints one line per rank when all passed.
"""

from __future__ import annotations

import datetime
import sys

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import InvalidArgument
from ferrodist.testing import (
    assert_reduced,
    ref_all_gather_into_tensor,
    ref_all_gather_object,
    ref_all_to_all_single,
    ref_broadcast_object_list,
    ref_gather_object,
    ref_reduce_scatter_tensor,
    ref_scatter_object_list,
)

SEED = 20261125


class Unpicklable:
    def __reduce__(self):
        raise TypeError("not today")


def objects(rng: np.random.Generator, count: int) -> list:
    kinds = [
        lambda: int(rng.integers(-(10**12), 10**12)) * 10**20,  # a big integer
        lambda: "text-" + "x" * int(rng.integers(0, 300)),
        lambda: {"nested": [float(rng.random()), (1, b"\x00" * int(rng.integers(0, 5000)))]},
        lambda: None,
    ]
    return [kinds[int(rng.integers(0, len(kinds)))]() for _ in range(count)]


def check_objects(rng: np.random.Generator, rank: int, size: int) -> int:
    mine = objects(rng, size)
    out = [None] * size
    dist.all_gather_object(out, mine[rank])
    assert out == ref_all_gather_object(mine)[rank], "all_gather_object"

    dst = int(rng.integers(0, size))
    gathered = [None] * size if rank == dst else None
    dist.gather_object(mine[rank], gathered, dst=dst)
    assert gathered == ref_gather_object(mine, dst)[rank], "gather_object"

    src = int(rng.integers(0, size))
    lists = [objects(rng, 3) for _ in range(size)]
    got = list(lists[rank])
    dist.broadcast_object_list(got, src=src, timeout=datetime.timedelta(seconds=60))
    assert got == ref_broadcast_object_list(lists, src)[rank], "broadcast_object_list"

    inputs = objects(rng, size)
    one = [None]
    dist.scatter_object_list(one, inputs if rank == src else None, src=src)
    assert one == ref_scatter_object_list(inputs, src, size)[rank], "scatter_object_list"

    try:  # an object that cannot be pickled: every rank raises, nothing is left behind
        dist.all_gather_object([None] * size, Unpicklable() if rank == size - 1 else rank)
    except InvalidArgument as exc:
        assert f"the object of rank {size - 1} cannot be pickled" in str(exc), str(exc)
    else:
        raise AssertionError("an unpicklable object went through all_gather_object")
    return 5


def check_tensors(rng: np.random.Generator, rank: int, size: int) -> int:
    inputs = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(size)]
    for stacked in (False, True):
        want = ref_all_gather_into_tensor(inputs, stacked=stacked)[rank]
        out = np.zeros_like(want)
        dist.all_gather_into_tensor(out, inputs[rank])
        np.testing.assert_array_equal(out, want, err_msg="all_gather_into_tensor")

        whole = [rng.integers(-50, 50, (size, 4) if stacked else (size * 4,)).astype(np.int64) for _ in range(size)]
        want = ref_reduce_scatter_tensor(whole, "sum", stacked=stacked)[rank]
        out = np.zeros(4, np.int64)
        work = dist.reduce_scatter_tensor(out, whole[rank], "sum", async_op=True)
        work.wait(30)
        np.testing.assert_array_equal(out, want, err_msg="reduce_scatter_tensor")

    floats = [rng.standard_normal(size * 5) for _ in range(size)]
    out = np.zeros(5)
    dist.reduce_scatter_tensor(out, floats[rank], dist.ReduceOp.AVG)
    assert_reduced(out, [f[rank * 5 : (rank + 1) * 5] for f in floats], "avg", what="reduce_scatter_tensor avg")

    matrix = rng.integers(0, 4, (size, size))
    matrix[0, size - 1] = 0  # an empty block too
    rows = [rng.standard_normal((int(matrix[i].sum()), 2)) for i in range(size)]
    want = ref_all_to_all_single(rows, matrix.tolist())[rank]
    out = np.zeros((int(matrix[:, rank].sum()), 2))
    dist.all_to_all_single(out, rows[rank], matrix[:, rank].tolist(), matrix[rank].tolist())
    np.testing.assert_array_equal(out, want, err_msg="all_to_all_single (uneven)")
    even = np.arange(size * 2.0) + 100 * rank
    out = np.empty(size * 2)
    dist.all_to_all_single(out, even)
    np.testing.assert_array_equal(out, [100 * i + 2 * rank + k for i in range(size) for k in range(2)])
    return 6


def check_point_to_point(rank: int, size: int, backend: str) -> int:
    right, left = (rank + 1) % size, (rank - 1) % size
    got_left, got_right = np.zeros(1000), np.zeros(1000)
    ops = [
        dist.P2POp(dist.isend, np.full(1000, rank * 1.0), right, tag=1),
        dist.P2POp(dist.irecv, got_left, left, tag=1),
        dist.P2POp(dist.isend, np.full(1000, rank * 10.0), left, tag=2, group=dist.group.WORLD),
        dist.P2POp(dist.irecv, got_right, right, tag=2),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait(datetime.timedelta(seconds=60))
    assert (got_left == left).all() and (got_right == right * 10.0).all(), "batch_isend_irecv"

    pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
    if rank == 1:
        dist.send(np.array([3.0, 4.0]), dst=0, group=pair)
    elif rank == 0:
        got = np.zeros(2)
        assert dist.recv(got, group=pair) == 1 and got.tolist() == [3.0, 4.0], "recv without src"
    assert dist.get_backend() == backend and dist.get_backend(pair) == backend and dist.is_available()
    return 3


def main() -> None:
    backend = sys.argv[1]
    world = dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    rank, size = world.rank, world.size
    rng = np.random.default_rng(SEED)
    checks = check_objects(rng, rank, size)
    checks += check_tensors(rng, rank, size)
    checks += check_point_to_point(rank, size, backend)
    dist.barrier(device_ids=[0])
    dist.monitored_barrier(timeout=30, wait_all_ranks=True)
    checks += 2
    print(f"rank {rank} of {size}: {checks} checks of torch's calls passed over {backend}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
