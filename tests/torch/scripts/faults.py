"""Failures on backend "ferrodist" under torchrun (``faults.py MODE OUTDIR``): every rank
that is not the culprit writes ``OUTDIR/error<rank>.json`` with the class, message and
seconds its failing call took, and what a next all_reduce on the group raised (``after``:
the group is aborted, so ``GroupAborted`` at once), then exits 1.

Modes:
    kill: rank 1 dies (SIGKILL) while the others are in an all_reduce.
    mismatch: rank 1 all-reduces 20 elements, the others 10.
    skip: rank 1 never calls the second all_reduce (the group's timeout is 3 s).
    ddp-kill: rank 1 dies in the middle of DDP training (the others are in backward).

torchrun stops the other ranks (SIGTERM) as soon as its monitor sees one fail, which can be
before a survivor has seen the failure itself; the ranks that must record an error ignore
SIGTERM, so what they record is what ferrodist raised (their own deadlines end them).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ferrodist.torch  # noqa: F401  (registers the backend)


def describe(exc: BaseException, seconds: float) -> dict:
    return {
        "class": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "seconds": seconds,
        "peer": getattr(exc, "peer", None),
        "waiting_for": list(getattr(exc, "waiting_for", None) or []),
    }


def record(out: Path, rank: int, exc: BaseException, seconds: float) -> None:
    error = describe(exc, seconds)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as after:
        error["after"] = describe(after, time.monotonic() - start)
    else:
        error["after"] = None
    (out / f"error{rank}.json").write_text(json.dumps(error))


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    timeout = timedelta(seconds=3 if mode == "skip" else 60)
    dist.init_process_group("ferrodist", timeout=timeout)
    rank = dist.get_rank()
    if rank != 1 or mode == "mismatch":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (out / f"pid{rank}").write_text(str(os.getpid()))
    x = torch.ones(10)
    dist.all_reduce(x)  # everyone is here
    start = time.monotonic()
    try:
        if mode == "kill":
            if rank == 1:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1 << 16))
        elif mode == "mismatch":
            dist.all_reduce(torch.ones(20 if rank == 1 else 10))
        elif mode == "skip":
            if rank == 1:
                time.sleep(30)  # stuck elsewhere; torchrun tears it down once the others fail
                return 0
            dist.all_reduce(torch.ones(10))
        elif mode == "ddp-kill":
            torch.manual_seed(0)
            model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)))
            for step in range(1000):
                if rank == 1 and step == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                start = time.monotonic()
                model(torch.randn(4, 256)).sum().backward()
        else:
            raise SystemExit(f"unknown mode {mode}")
    except Exception as exc:
        record(out, rank, exc, time.monotonic() - start)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
