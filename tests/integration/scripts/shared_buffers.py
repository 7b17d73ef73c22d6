"""Run by tests/integration/test_shared_buffers.py under ``ferrodist run -n N``:
``shared_buffers.py MODE OUTDIR``.

MODE values: every rank allocates arrays with ``shared_zeros`` and checks what the
all_reduce over them gives against numpy, call after call with new data each time (so a
rank that read a peer's array before it was written, or after it was written again for the
next call, gets a wrong value). Before each call this rank's data slots in the arena are
filled with a pattern and checked after it: a call that read its arrays in place leaves
them as they were (a copying one writes every byte of its tensor through them).
MODE race: the same calls with the ranks out of step on purpose: rank 1 writes its data
50 ms late and reads its peers' arrays 20 ms late, and rank 0 overwrites its array the
moment a call returns. A call that read a peer's array before the peer had written it, or
let a rank return while a peer still read its array, gives rank 1 a wrong value.
MODE mismatch: rank 0 passes a shared array, the others an ordinary one; MODE places:
rank 0 passes the first half of a shared array, the others the second: every rank writes
the error it got.
MODE ddp: ferrodist.ddp.DDP over a ferrodist.nn model with a bucket over the in-place
threshold: which buckets live in shared memory, and how far three steps are from one
process on the whole batch.
MODE ddp-torch: the same over a PyTorch model with a bucket of one parameter and a bucket
of two, both of a size that reads in place: which buckets live in shared memory.
MODE hold: after the checks, rank 1 writes its pid to OUTDIR/ready and waits to be killed.
Each rank writes OUTDIR/rank<R>.json: what it checked.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import FerrodistError, ReduceOp
from ferrodist.transport._shm.collectives import IN_PLACE_BYTES, IN_PLACE_UP_TO

PATTERN = 0xA5


def data(call: int, rank: int, n: int, dtype: np.dtype) -> np.ndarray:
    """Values for this call and rank that sum exactly in float32 (small integers)."""
    values = (np.arange(n, dtype=np.int64) * (rank + 3) + call * 7) % 61 - 30
    return values.astype(dtype)


class Late(np.ndarray):
    """A peer's array that rank 1 reads late (every slice of it waits 20 ms first)."""

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return np.asarray(self)[key]


def race(world: dist.ProcessGroup, rank: int, size: int) -> dict[str, object]:
    shared = world._route.native.shared
    if rank == 1:
        peers = shared.peers
        shared.peers = lambda *args: [view.view(Late) for view in peers(*args)]
    buf = dist.shared_zeros(IN_PLACE_BYTES // 4 * 2, "float32")
    for call in range(6):
        inputs = [data(call, r, buf.shape[0], np.dtype(np.float64)) for r in range(size)]
        if rank == 1:
            time.sleep(0.05)
        buf[...] = inputs[rank]
        dist.all_reduce(buf)
        got = buf.copy()
        if rank == 0:
            buf[...] = -1000.0
        assert np.array_equal(got, np.sum(inputs, axis=0)), f"rank {rank} call {call}: wrong values"
    return {"rank": rank, "race_calls": 6}


def ddp(world: dist.ProcessGroup, rank: int, size: int) -> dict[str, object]:
    from ferrodist import nn
    from ferrodist.ddp import DistributedDataParallel

    def model(seed: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(512, 300, rng=seed, dtype=np.float64),
            nn.Tanh(),
            nn.Linear(300, 3, rng=seed + 1, dtype=np.float64),
        )

    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((8 * size, 512)), rng.integers(0, 3, size=8 * size)) for _ in range(3)]
    trained = DistributedDataParallel(model(10 * rank), world)
    shared = world._route.native.shared
    flats = trained._reducer.flats
    mine = slice(8 * rank, 8 * (rank + 1))
    reference = model(0)
    for net, part in ((trained, mine), (reference, slice(None))):
        opt, loss = nn.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss()
        for x, y in batches:
            opt.zero_grad()
            loss(net(x[part]), y[part])
            net.backward(loss.backward())
            opt.step()
    got, want = trained.state_dict(), reference.state_dict()
    return {
        "buckets": len(flats),
        "sizes": [int(f.nbytes) for f in flats],
        "shared": sum(shared.find(f) is not None for f in flats),
        "in_range": sum(IN_PLACE_BYTES <= f.nbytes <= IN_PLACE_UP_TO for f in flats),
        "in_place": sum(IN_PLACE_BYTES <= f.nbytes <= IN_PLACE_UP_TO and shared.find(f) is not None for f in flats),
        "difference": max(float(np.max(np.abs(got[k] - want[k]))) for k in want),
    }


def ddp_torch(world: dist.ProcessGroup, rank: int, size: int) -> dict[str, object]:
    import torch

    from ferrodist.ddp import DistributedDataParallel

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        # buckets (caps below): the second layer's one weight (2.1 MB), then the first
        # layer's weight and bias (2.3 MB); both sizes read in place
        return torch.nn.Sequential(
            torch.nn.Linear(512, 560).double(), torch.nn.Tanh(), torch.nn.Linear(560, 468, bias=False).double()
        )

    rng = np.random.default_rng(5)
    batches = [
        (torch.from_numpy(rng.standard_normal((4 * size, 512))), torch.from_numpy(rng.standard_normal((4 * size, 468))))
        for _ in range(3)
    ]
    trained = DistributedDataParallel(model(10 + rank), world, bucket_cap_mb=2.3, first_bucket_cap_mb=1.2)
    reference = model(10)
    mine = slice(4 * rank, 4 * (rank + 1))
    for net, part in ((trained, mine), (reference, slice(None))):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in batches:
            opt.zero_grad()
            ((net(x[part]) - y[part]) ** 2).mean().backward()
            opt.step()
    shared = world._route.native.shared
    buckets = trained._reducer.plan.buckets
    flats = trained._reducer.flats
    got, want = trained.module.state_dict(), reference.state_dict()
    return {
        "buckets": [
            (len(b.params), int(f.nbytes), shared.find(f.numpy() if hasattr(f, "numpy") else f) is not None)
            for b, f in zip(buckets, flats, strict=True)
        ],
        "difference": max(float((got[k] - want[k]).abs().max()) for k in want),
    }


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    world = dist.init_process_group("shm")
    rank, size = world.rank, world.size
    if mode in ("ddp", "ddp-torch"):
        report = ddp(world, rank, size) if mode == "ddp" else ddp_torch(world, rank, size)
        (outdir / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()
        return
    if mode in ("mismatch", "places"):
        n = IN_PLACE_BYTES // 4 * 2
        shared = dist.shared_zeros(2 * n, "float32")
        if mode == "mismatch":
            x = shared[:n] if rank == 0 else np.zeros(n, np.float32)
        else:
            x = shared[:n] if rank == 0 else shared[n:]
        x[...] = 1
        try:
            dist.all_reduce(x, timeout=20)
            said = {"rank": rank, "error": None}
        except FerrodistError as exc:
            said = {"rank": rank, "error": type(exc).__name__, "message": str(exc)}
        (outdir / f"rank{rank}.json").write_text(json.dumps(said))
        return
    if mode == "race":
        (outdir / f"rank{rank}.json").write_text(json.dumps(race(world, rank, size)))
        dist.destroy_process_group()
        return
    arena = world.transport._arena  # the slots a copying all_reduce goes through
    assert arena is not None, "this test runs on the shm backend"
    mine = arena.data[rank * arena.slots * arena.chunk : (rank + 1) * arena.slots * arena.chunk]

    def mark_slots() -> None:
        """Fill this rank's slots with the pattern once no peer reads them (a barrier moves
        no data through the slots)."""
        dist.barrier()
        mine[...] = PATTERN
        dist.barrier()

    report: dict[str, object] = {"rank": rank, "calls": 0, "slots_untouched": 0}
    big = IN_PLACE_BYTES // 4 * 3 + 5  # float32 elements: over the threshold, not a multiple of the ranks
    buffers = {
        "float32": dist.shared_zeros(big, "float32"),
        "float64": dist.shared_zeros((3, big // 3), np.float64),
        "bfloat16": dist.shared_zeros(big, "bfloat16"),
    }
    assert all(not b.any() for b in buffers.values()), "a shared array starts zero-filled"
    for call in range(12):
        for name, buf in buffers.items():
            flat = buf.reshape(-1)
            piece = flat[call % 3 : flat.shape[0] - (call % 5)]  # a slice at the same place on every rank
            op = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG)[call % 3]
            if name == "bfloat16" and op is ReduceOp.AVG:
                op = ReduceOp.SUM
            inputs = [data(call, r, piece.shape[0], np.dtype(np.float64)) for r in range(size)]
            want = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max, ReduceOp.AVG: np.mean}[op](inputs, axis=0)
            piece[...] = inputs[rank].astype(piece.dtype)
            mark_slots()
            dist.all_reduce(piece, op)
            got = piece.astype(np.float64)
            if not np.array_equal(got, want.astype(piece.dtype).astype(np.float64)):
                bad = int(np.flatnonzero(got != want.astype(piece.dtype).astype(np.float64))[0])
                raise AssertionError(f"rank {rank} call {call} {name} {op.name}: [{bad}] {got[bad]} != {want[bad]}")
            report["calls"] = int(report["calls"]) + 1  # type: ignore[call-overload]
            if (mine == PATTERN).all():
                report["slots_untouched"] = int(report["slots_untouched"]) + 1  # type: ignore[call-overload]
    # an ordinary array of the same size goes through the slots
    plain = np.ones(big, np.float32)
    mark_slots()
    dist.all_reduce(plain)
    report["plain_touched_slots"] = bool((mine != PATTERN).any())
    report["plain_ok"] = bool((plain == size).all())
    # the same bits as the slots give, on data whose sum rounds
    rng = np.random.default_rng(rank)
    for name, buf in buffers.items():
        flat = buf.reshape(-1)
        flat[...] = rng.standard_normal(flat.shape[0]).astype(flat.dtype)
        copy = flat.copy()
        dist.all_reduce(flat)
        dist.all_reduce(copy)
        report[f"same_bits_{name}"] = bool(np.array_equal(flat.view(np.uint8), copy.view(np.uint8)))
    (outdir / f"rank{rank}.json").write_text(json.dumps(report))
    if mode == "hold" and rank == 1:
        (outdir / "ready").write_text(str(os.getpid()))
        time.sleep(60)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
