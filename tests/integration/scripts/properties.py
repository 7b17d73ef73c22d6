"""Run by tests/integration/test_real_processes.py as `ferrodist run -n N properties.py CASES BACKEND`.

Every rank walks the same list of cases: each collective with each dtype and, for the
reducing ones, each op that applies (83 (dtype, op) pairs x all_reduce with both
algorithms, reduce and reduce_scatter; 13 dtypes x broadcast, all_gather, gather,
scatter and all_to_all), then random cases until CASES. Shapes (0-d and empty
included), roots and values are drawn from a seeded generator that every rank seeds
alike, so every rank knows every rank's input and checks its result against the numpy
reference locally.
"""

from __future__ import annotations

import sys

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import ALL_DTYPES, InvalidArgument, ReduceOp, bfloat16, reducer
from ferrodist.core.kernels import wait_for_compiles
from ferrodist.testing import assert_reduced, ref_all_to_all

SEED = 20261122
REDUCING = ("all_reduce/ring", "all_reduce/recursive_doubling", "reduce", "reduce_scatter")
MOVING = ("broadcast", "all_gather", "gather", "scatter", "all_to_all")
#: Set by main: over shm, all_reduce (no algorithm named) and reduce fold the ranks' data in
#: rank order as the kernels do, so their results must be the kernels' bits, not only close.
KERNEL_BITS = {"on": False}


def kernel_result(inputs: list[np.ndarray], dt, op) -> np.ndarray:
    out = np.empty(inputs[0].size, dt.numpy)
    divisor = float(len(inputs)) if op is ReduceOp.AVG else 1.0
    reducer(dt, op)(out, [v.reshape(-1) for v in inputs], divisor)
    return out.reshape(inputs[0].shape)


def planned_cases() -> list[tuple[str, object, object]]:
    cases = []
    for kind in REDUCING:
        for dt in ALL_DTYPES:
            for op in sorted(dt.ops, key=lambda o: o.value):
                cases.append((kind, dt, op))
    for kind in MOVING:
        for dt in ALL_DTYPES:
            cases.append((kind, dt, None))
    return cases


def values(rng: np.random.Generator, dt, shape, op) -> np.ndarray:
    if dt.kind == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.is_floating:
        bound = 2.0 if op is ReduceOp.PRODUCT else 1000.0
        return rng.uniform(-bound, bound, shape).astype(np.float32).astype(dt.numpy)
    info = np.iinfo(dt.numpy)
    return rng.integers(
        int(info.min), int(info.max), shape, dtype=np.int64 if info.min < 0 else np.uint64, endpoint=True
    ).astype(dt.numpy)


def shape_for(rng: np.random.Generator) -> tuple[int, ...]:
    choice = rng.integers(0, 6)
    if choice == 0:
        return ()
    if choice == 1:
        return (0,)
    dims = rng.integers(1, 4)
    return tuple(int(n) for n in rng.integers(1, 6, dims)) if choice < 5 else (int(rng.integers(60, 3000)),)


def run_case(index: int, kind: str, dt, op, size: int, rank: int, again: bool = False) -> None:
    """``again``: the same call a second time, with no algorithm named, so that shm and MPI
    take their fast path (the checks of the first call remembered)."""
    rng = np.random.default_rng([SEED, index])
    shape = shape_for(rng)
    root = int(rng.integers(0, size))
    inputs = [values(np.random.default_rng([SEED, index, r]), dt, shape, op) for r in range(size)]
    mine = inputs[rank].copy()
    where = f"case {index}: {kind} {dt.name} {op} shape {shape} root {root}"
    if kind.startswith("all_reduce"):
        if again:  # a first call with no algorithm named remembers its checks; this one is fast
            dist.all_reduce(inputs[rank].copy(), op)
            if KERNEL_BITS["on"]:  # and runs shm's compiled loop, which the first call set loading
                wait_for_compiles(120)
        dist.all_reduce(mine, op, algorithm=None if again else kind.split("/")[1])
        assert_reduced(mine, inputs, op, what=where)
        if KERNEL_BITS["on"] and again and mine.size:  # no algorithm named: shm's own loop ran
            assert mine.tobytes() == kernel_result(inputs, dt, op).tobytes(), f"{where}: not the kernels' bits"
    elif kind == "reduce":
        dist.reduce(mine, root, op)
        if rank == root:
            assert_reduced(mine, inputs, op, what=where)
            if KERNEL_BITS["on"] and mine.size:
                assert mine.tobytes() == kernel_result(inputs, dt, op).tobytes(), f"{where}: not the kernels' bits"
        else:
            np.testing.assert_array_equal(mine, inputs[rank], err_msg=where)
    elif kind == "reduce_scatter":
        blocks = [
            [values(np.random.default_rng([SEED, index, r, i]), dt, shape, op) for i in range(size)]
            for r in range(size)
        ]
        out = np.zeros(shape, dt.numpy)
        mine_blocks = blocks[rank] if index % 2 else np.stack(blocks[rank])
        dist.reduce_scatter(out, mine_blocks, op)
        assert_reduced(out, [blocks[r][rank] for r in range(size)], op, what=where)
    elif kind == "broadcast":
        dist.broadcast(mine, root)
        np.testing.assert_array_equal(mine, inputs[root], err_msg=where)
    elif kind == "all_gather":
        # Odd cases pass a list of tensors, even ones a single tensor.
        out = [np.zeros(shape, dt.numpy) for _ in range(size)] if index % 2 else np.zeros((size, *shape), dt.numpy)
        dist.all_gather(out, inputs[rank])
        np.testing.assert_array_equal(np.stack(out), np.stack(inputs), err_msg=where)
    elif kind == "gather":
        out = None
        if rank == root:
            out = [np.zeros(shape, dt.numpy) for _ in range(size)] if index % 2 else np.zeros((size, *shape), dt.numpy)
        dist.gather(inputs[rank], out, root)
        if rank == root:
            np.testing.assert_array_equal(np.stack(out), np.stack(inputs), err_msg=where)
    elif kind == "scatter":
        source = (list(inputs) if index % 2 else np.stack(inputs)) if rank == root else None
        out = np.zeros(shape, dt.numpy)
        dist.scatter(out, source, root)
        np.testing.assert_array_equal(out, inputs[rank], err_msg=where)
    elif kind == "all_to_all":
        counts = np.random.default_rng([SEED, index, 99]).integers(0, 5, (size, size))
        sent = [
            [values(np.random.default_rng([SEED, index, i, j]), dt, (int(counts[i][j]),), None) for j in range(size)]
            for i in range(size)
        ]
        outs = [np.zeros(int(counts[i][rank]), dt.numpy) for i in range(size)]
        dist.all_to_all(outs, sent[rank])
        for got, want in zip(outs, ref_all_to_all(sent)[rank], strict=True):
            np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        raise AssertionError(kind)


def check_subgroups(rank: int, size: int) -> None:
    """Every rank makes every group; members reduce and broadcast within theirs."""
    for members in ([0], sorted({0, size - 1}), list(range(1, size)) or [0], list(range(size))):
        group = dist.new_group(members)
        if rank not in members:
            assert not group.is_member
            continue
        for dtype in (np.int64, np.float16):  # MPI's own reduction, then ferrodist's
            x = np.array([rank + 1, 10 * (rank + 1)], dtype)
            dist.all_reduce(x, group=group)
            expected = np.array([sum(m + 1 for m in members), 10 * sum(m + 1 for m in members)], dtype)
            np.testing.assert_array_equal(x, expected, err_msg=f"all_reduce on {members}")
        y = np.array([rank], np.int32)
        dist.broadcast(y, src=members[-1], group=group)
        assert y[0] == members[-1], (members, y)
        dist.barrier(group=group)


def check_compressed(rank: int, size: int) -> None:
    """all_reduce(x, op, compress="bf16") of float32 arrays is, to the bit, the same group's
    all_reduce of x rounded to bfloat16, widened (on shm: the kernels' bits of the rounded
    inputs too), for every float op and sizes from none to many chunks; each twice on shm,
    the second time on the compiled loops."""
    ops = sorted(ReduceOp.__members__.values(), key=lambda o: o.value)
    for index, n in enumerate([0, 1, 7, 3000, 20_000, 150_001]):
        for op in (o for o in ops if o in bfloat16.ops):
            for attempt in range(2 if KERNEL_BITS["on"] else 1):
                inputs = [values(np.random.default_rng([SEED, 7, index, r]), bfloat16, (n,), op) for r in range(size)]
                wide = [v.astype(np.float32) + np.float32(1 / 3) for v in inputs]  # bits bfloat16 must round
                mine, rounded = wide[rank].copy(), wide[rank].astype(bfloat16.numpy)
                where = f"compressed all_reduce {op.name} of {n} (attempt {attempt})"
                dist.all_reduce(rounded, op)
                dist.all_reduce(mine, op, compress="bf16")
                assert mine.tobytes() == rounded.astype(np.float32).tobytes(), f"{where}: not the rounded call's bits"
                if KERNEL_BITS["on"] and n:
                    want = kernel_result([w.astype(bfloat16.numpy) for w in wide], bfloat16, op)
                    assert rounded.tobytes() == want.tobytes(), f"{where}: not the kernels' bits"
                if KERNEL_BITS["on"]:
                    wait_for_compiles(120)


def check_options_after_the_fast_path() -> None:
    """A call already validated once takes a fast path on shm and MPI; options it cannot
    honour must still be checked there."""
    x = np.ones(3, np.float64)
    dist.all_reduce(x)
    dist.all_reduce(x)
    try:
        dist.all_reduce(x, compress="bf16")
    except InvalidArgument as exc:
        assert "needs a float32 tensor" in str(exc), exc
    else:
        raise AssertionError("compress='bf16' on a float64 tensor was accepted after the fast path")


def check_large_all_reduce_over_mpi(world, rank: int, size: int) -> None:
    """Over MPI, an all_reduce above the native limit runs our ring (Open MPI's
    non-blocking Iallreduce is several times slower there); a small one runs MPI's."""
    native = world._route.native
    calls = []
    mpi_all_reduce = native.all_reduce
    native.all_reduce = lambda *args, **kw: (calls.append(args[0].nbytes), mpi_all_reduce(*args, **kw))[1]
    try:
        big = np.full(native.all_reduce_up_to // 4 + 1, rank + 1.0, np.float32)
        for _ in range(2):  # the second call takes the fast path
            x = big.copy()
            dist.all_reduce(x)
            assert (x == size * (size + 1) / 2).all(), "large all_reduce over mpi"
        small = np.full(16, rank + 1.0, np.float32)
        dist.all_reduce(small, ReduceOp.AVG)
        assert (small == (size + 1) / 2).all(), "small all_reduce over mpi"
        assert calls == [small.nbytes], f"MPI's own all_reduce ran for {calls}, expected only the small one"
    finally:
        native.all_reduce = mpi_all_reduce


def main() -> None:
    total = int(sys.argv[1])
    backend = sys.argv[2] if len(sys.argv) > 2 else "tcp"
    KERNEL_BITS["on"] = backend == "shm"
    world = dist.init_process_group(backend, timeout=60)
    rank, size = world.rank, world.size
    cases = planned_cases()
    rng = np.random.default_rng(SEED)
    everything = [*REDUCING, *MOVING]
    while len(cases) < total:
        kind = everything[int(rng.integers(0, len(everything)))]
        dt = ALL_DTYPES[int(rng.integers(0, len(ALL_DTYPES)))]
        ops = sorted(dt.ops, key=lambda o: o.value)
        cases.append((kind, dt, ops[int(rng.integers(0, len(ops)))] if kind in REDUCING else None))
    for index, (kind, dt, op) in enumerate(cases):
        run_case(index, kind, dt, op, size, rank)
        if index % 2 == 0:  # even cases pass single arrays: those calls may take a fast path
            run_case(index, kind, dt, op, size, rank, again=True)
    check_subgroups(rank, size)
    check_compressed(rank, size)
    check_options_after_the_fast_path()
    if backend == "mpi":
        check_large_all_reduce_over_mpi(world, rank, size)
    dist.barrier()
    print(f"rank {rank} of {size}: {len(cases)} cases passed over {backend}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
