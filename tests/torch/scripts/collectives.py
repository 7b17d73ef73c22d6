"""Every torch.distributed collective on backend "ferrodist", checked against ferrodist's
numpy references (run under torchrun: ``collectives.py CASES``).

Every rank draws the same cases from one seeded generator; a case's inputs for rank r
come from a generator seeded with (case, r), so each rank computes every rank's inputs
and with them the reference result. Dtypes x ops cover what torch's Gloo runs (and AVG,
which Gloo lacks); shapes, roots and split sizes are drawn. Prints one line per rank:
``rank R of N: K cases passed over <transport>``.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _coalescing_manager

import ferrodist.torch  # noqa: F401  (registers the backend)
from ferrodist.core import bfloat16
from ferrodist.testing import (
    assert_reduced,
    ref_all_gather,
    ref_broadcast,
    ref_gather,
    ref_reduce,
    ref_reduce_scatter,
    ref_scatter,
)

FLOATS = ("float32", "float64", "float16", "bfloat16")
INTS = ("int8", "uint8", "int32", "int64")
OPS = {
    "float": ("SUM", "AVG", "PRODUCT", "MIN", "MAX"),
    "int": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "bool": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
}


def numpy_dtype(name: str) -> np.dtype:
    return bfloat16.numpy if name == "bfloat16" else np.dtype(name)


def values(case: int, rank: int, shape: tuple[int, ...], name: str, op: str = "SUM") -> np.ndarray:
    """Rank ``rank``'s input of case ``case`` (the same on every rank that computes it)."""
    rng = np.random.default_rng([case, rank])
    if name == "bool":
        return rng.random(shape) < 0.5
    if name in FLOATS:
        low, high = (0.5, 1.5) if op == "PRODUCT" else (-4.0, 4.0)
        return rng.uniform(low, high, shape).astype(numpy_dtype(name))
    info = np.iinfo(np.dtype(name))
    low, high = (-3, 4) if op == "PRODUCT" and info.min < 0 else (0, 4) if op == "PRODUCT" else (info.min, info.max)
    return rng.integers(low, high, shape, dtype=np.dtype(name), endpoint=False)


def to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype == bfloat16.numpy:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(bfloat16.numpy)
    return tensor.numpy()


def same(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    g = to_numpy(got)
    assert g.shape == want.shape and g.dtype == want.dtype, (what, g.shape, want.shape, g.dtype, want.dtype)
    assert np.array_equal(g.view(np.uint8), np.ascontiguousarray(want).view(np.uint8)), (what, g, want)


class Cases:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.count = 0
        self.rng = np.random.default_rng(2024)

    def next(self) -> int:
        self.count += 1
        return self.count

    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.rng.integers(1, 5, self.rng.integers(1, 3)))

    def inputs(self, case: int, shape: tuple[int, ...], name: str, op: str = "SUM") -> list[np.ndarray]:
        return [values(case, r, shape, name, op) for r in range(self.size)]


def run_reductions(c: Cases) -> None:
    kinds = [(n, "float") for n in FLOATS] + [(n, "int") for n in INTS] + [("bool", "bool")]
    for name, kind in kinds:
        for op in OPS[kind]:
            case, shape = c.next(), c.shape()
            ins = c.inputs(case, shape, name, op)
            t = to_torch(ins[c.rank])
            style = case % 3
            if style == 0:
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            elif style == 1:
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=True).wait()
            else:
                got = dist.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=True).get_future().wait()
                assert got[0] is t, "the future carries the reduced tensor itself"
            assert_reduced(to_numpy(t), ins, op, what=f"all_reduce {name} {op}")
            # reduce to every root, in turn
            case, shape = c.next(), c.shape()
            ins = c.inputs(case, shape, name, op)
            root = case % c.size
            t = to_torch(ins[c.rank])
            dist.reduce(t, dst=root, op=getattr(dist.ReduceOp, op))
            want = ref_reduce(ins, root, op)[c.rank]
            if c.rank == root:
                assert_reduced(to_numpy(t), ins, op, what=f"reduce {name} {op}")
            else:
                same(t, want, f"reduce {name} {op} leaves rank {c.rank} alone")
        # reduce_scatter, list and tensor forms
        op = OPS[kind][case % len(OPS[kind])]
        case, shape = c.next(), c.shape()
        blocks = [[values(case, r * 100 + i, shape, name, op) for i in range(c.size)] for r in range(c.size)]
        out = to_torch(np.zeros(shape, numpy_dtype(name)))
        dist.reduce_scatter(out, [to_torch(b) for b in blocks[c.rank]], op=getattr(dist.ReduceOp, op))
        assert_reduced(to_numpy(out), [blocks[r][c.rank] for r in range(c.size)], op, what=f"reduce_scatter {name}")
        assert ref_reduce_scatter(blocks, op)[c.rank].shape == shape
        out = to_torch(np.zeros(shape, numpy_dtype(name)))
        dist.reduce_scatter_tensor(out, to_torch(np.concatenate(blocks[c.rank])), op=getattr(dist.ReduceOp, op))
        assert_reduced(to_numpy(out), [blocks[r][c.rank] for r in range(c.size)], op, what="reduce_scatter_tensor")


def run_copies(c: Cases) -> None:
    for name in (*FLOATS, *INTS, "bool"):
        case, shape = c.next(), c.shape()
        ins = c.inputs(case, shape, name)
        root = case % c.size
        t = to_torch(ins[c.rank])
        dist.broadcast(t, src=root)
        same(t, ref_broadcast(ins, root)[c.rank], f"broadcast {name}")

        case, shape = c.next(), c.shape()
        ins = c.inputs(case, shape, name)
        outs = [to_torch(np.zeros(shape, numpy_dtype(name))) for _ in range(c.size)]
        dist.all_gather(outs, to_torch(ins[c.rank]))
        for got, want in zip(outs, ref_all_gather(ins)[c.rank], strict=True):
            same(got, want, f"all_gather {name}")
        flat = to_torch(np.zeros((c.size * shape[0], *shape[1:]), numpy_dtype(name)))
        dist.all_gather_into_tensor(flat, to_torch(ins[c.rank]))
        same(flat, np.concatenate(ins), f"all_gather_into_tensor {name}")

        case, shape = c.next(), c.shape()
        ins = c.inputs(case, shape, name)
        root = case % c.size
        gathered = [to_torch(np.zeros(shape, numpy_dtype(name))) for _ in range(c.size)] if c.rank == root else None
        dist.gather(to_torch(ins[c.rank]), gathered, dst=root)
        want_gather = ref_gather(ins, root)[c.rank]
        if c.rank == root:
            assert want_gather is not None and gathered is not None
            for got, want in zip(gathered, want_gather, strict=True):
                same(got, want, f"gather {name}")

        case, shape = c.next(), c.shape()
        parts = c.inputs(case, shape, name)
        root = case % c.size
        t = to_torch(np.zeros(shape, numpy_dtype(name)))
        dist.scatter(t, [to_torch(p) for p in parts] if c.rank == root else None, src=root)
        same(t, ref_scatter(parts, root, c.size)[c.rank], f"scatter {name}")


def run_all_to_all(c: Cases) -> None:
    for name in ("float32", "int64", "bfloat16", "uint8"):
        case = c.next()
        # rows[i][j]: how many rows rank i sends to rank j (some zero)
        rows = np.random.default_rng(case).integers(0, 4, (c.size, c.size))
        data = {
            (i, j): values(case, 1000 * i + j, (int(rows[i][j]), 3), name) for i in range(c.size) for j in range(c.size)
        }
        outs = [to_torch(np.zeros((int(rows[i][c.rank]), 3), numpy_dtype(name))) for i in range(c.size)]
        dist.all_to_all(outs, [to_torch(data[(c.rank, j)]) for j in range(c.size)])
        for i in range(c.size):
            same(outs[i], data[(i, c.rank)], f"all_to_all {name} from {i}")
        # all_to_all_single with uneven splits, then even
        send = np.concatenate([data[(c.rank, j)] for j in range(c.size)])
        out = to_torch(np.zeros((int(rows[:, c.rank].sum()), 3), numpy_dtype(name)))
        dist.all_to_all_single(
            out, to_torch(send), [int(rows[i][c.rank]) for i in range(c.size)], [int(x) for x in rows[c.rank]]
        )
        same(out, np.concatenate([data[(i, c.rank)] for i in range(c.size)]), f"all_to_all_single uneven {name}")
        even = values(case, c.rank, (c.size * 2,), name)
        out = to_torch(np.zeros(c.size * 2, numpy_dtype(name)))
        dist.all_to_all_single(out, to_torch(even))
        want = np.concatenate(
            [values(case, i, (c.size * 2,), name)[2 * c.rank : 2 * c.rank + 2] for i in range(c.size)]
        )
        same(out, want, f"all_to_all_single even {name}")


def run_point_to_point(c: Cases) -> None:
    n, me = c.size, c.rank
    nxt, prv = (me + 1) % n, (me - 1) % n
    case = c.next()
    mine, theirs = values(case, me, (5,), "float32"), values(case, prv, (5,), "float32")
    got = torch.zeros(5)
    if me % 2 == 0:
        dist.send(to_torch(mine), nxt, tag=3)
        dist.recv(got, prv, tag=3)
    else:
        dist.recv(got, prv, tag=3)
        dist.send(to_torch(mine), nxt, tag=3)
    same(got, theirs, "send/recv ring")
    got = torch.zeros(5)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.irecv, got, prv, tag=4), dist.P2POp(dist.isend, to_torch(mine), nxt, tag=4)]
    )
    for work in works:
        work.wait()
    same(got, theirs, "batch_isend_irecv ring")
    got = torch.zeros(5)
    recv = dist.irecv(got, src=prv, tag=5)
    send = dist.isend(to_torch(mine), dst=nxt, tag=5)
    assert recv.get_future().wait()[0] is got
    send.wait()
    same(got, theirs, "irecv future")


def run_layouts_and_forms(c: Cases) -> None:
    """Non-contiguous tensors, coalesced calls, object and functional collectives, subgroups."""
    n, me = c.size, c.rank
    case = c.next()
    ins = c.inputs(case, (4, 3), "float64")
    t = to_torch(ins[me].T.copy()).T  # a transposed view: not contiguous
    assert not t.is_contiguous()
    dist.all_reduce(t)
    assert_reduced(t.numpy(), ins, "SUM", what="all_reduce of a transposed view")
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert_reduced(t.numpy() / n, ins, "SUM", what="async all_reduce of a transposed view (copied back)")

    case = c.next()
    tensors = [to_torch(values(case, 10 * me + k, (k + 1,), "float32")) for k in range(3)]
    expected = [[values(case, 10 * r + k, (k + 1,), "float32") for r in range(n)] for k in range(3)]
    with _coalescing_manager(async_ops=True) as cm:
        for tensor in tensors:
            dist.all_reduce(tensor)
    cm.wait()
    for k, tensor in enumerate(tensors):
        assert_reduced(tensor.numpy(), expected[k], "SUM", what=f"coalesced all_reduce {k}")
    outs = [torch.zeros(n * 2) for _ in range(2)]
    with _coalescing_manager():
        for k in range(2):
            dist.all_gather_into_tensor(outs[k], torch.full((2,), float(10 * me + k)))
    for k in range(2):
        assert outs[k].tolist() == [float(10 * r + k) for r in range(n) for _ in range(2)], outs

    objects: list[object] = [None] * n
    dist.all_gather_object(objects, {"rank": me, "word": "x" * me})
    assert objects == [{"rank": r, "word": "x" * r} for r in range(n)], objects
    box = [("from root", 7)] if me == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    assert box == [("from root", 7)]

    reduced = funcol.all_reduce(torch.full((3,), float(me + 1)), "sum", dist.group.WORLD)
    assert reduced.tolist() == [float(n * (n + 1) // 2)] * 3, reduced

    sub = dist.new_group([0, 1], backend="ferrodist")
    if me in (0, 1):
        x = torch.full((2,), float(me + 5))
        dist.all_reduce(x, group=sub)
        assert x.tolist() == [11.0, 11.0], x
    dist.barrier()
    dist.barrier(async_op=True).wait(timeout=timedelta(seconds=30))


def time_a_new_group() -> float:
    """new_group and its first all_reduce, in milliseconds; the group shares the world's
    transport (checked here: same object)."""
    dist.barrier()
    start = time.perf_counter()
    group = dist.new_group(list(range(dist.get_world_size())), backend="ferrodist")
    x = torch.ones(4)
    dist.all_reduce(x, group=group)
    took = (time.perf_counter() - start) * 1000
    assert x.tolist() == [float(dist.get_world_size())] * 4, x
    world = dist.group.WORLD.ferrodist_group
    assert group.ferrodist_group.transport is world.transport, "a new group opened a transport of its own"
    dist.destroy_process_group(group)
    return took


def main() -> None:
    from ferrodist.torch import _register

    connects = []
    real = _register.connect
    _register.connect = lambda *args, **kwargs: connects.append(args[0]) or real(*args, **kwargs)
    dist.init_process_group("ferrodist")
    c = Cases(dist.get_rank(), dist.get_world_size())
    run_reductions(c)
    run_copies(c)
    run_all_to_all(c)
    run_point_to_point(c)
    run_layouts_and_forms(c)
    took = min(time_a_new_group() for _ in range(3))
    transport = type(dist.group.WORLD.ferrodist_group.transport).__name__
    dist.destroy_process_group()
    print(f"rank {c.rank} of {c.size}: {c.count} cases passed over {transport}", flush=True)
    print(f"rank {c.rank}: transports started: {len(connects)}; new_group + first all_reduce: {took:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
