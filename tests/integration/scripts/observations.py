"""Run by tests/integration/test_failures.py: the failures issue 11 observed, one mode each.

    observations.py MODE OUTDIR BACKEND

MODE stop:       30 all_reduces (timeout 2 s); before call 5 rank 1 is stopped (SIGSTOP) for
                 4 s, then woken, and goes on calling like the others.
MODE stop0:      the same with rank 0, the host of the job's store, stopped.
MODE roots-OP:   every rank calls OP (broadcast, reduce, gather, scatter) naming itself
                 as the root.
MODE barrier:    rank 0 calls barrier while the others call all_reduce.
MODE kill:       like stop, but rank 2 kills itself with SIGKILL before call 5.

Each rank appends a JSON line per call to OUTDIR/rank{R}.jsonl: ``ok`` (checked against
what it must be), ``wrong``, or ``error`` (class, message, seconds, peer, waiting_for).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import FerrodistError


def main() -> None:
    mode, outdir, backend = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group(backend, timeout=30)
    rank, size = dist.get_rank(), dist.get_world_size()
    (outdir / f"pid{rank}").write_text(str(os.getpid()))
    log = open(outdir / f"rank{rank}.jsonl", "w", buffering=1)

    def attempt(i: int, fn, want=None, got=None) -> None:
        started = time.monotonic()
        try:
            fn()
        except FerrodistError as exc:
            entry = {"i": i, "outcome": "error", "class": type(exc).__name__, "message": str(exc)}
            entry["peer"] = getattr(exc, "peer", None)
            entry["waiting_for"] = list(getattr(exc, "waiting_for", ()))
        else:
            right = want is None or np.array_equal(got, want)
            entry = {"i": i, "outcome": "ok" if right else "wrong"}
        entry["seconds"] = round(time.monotonic() - started, 3)
        log.write(json.dumps(entry) + "\n")

    if mode in ("stop", "stop0", "kill"):
        stopped = 0 if mode == "stop0" else 1
        for i in range(30):
            if i == 5 and mode.startswith("stop") and rank == stopped:
                subprocess.Popen(["sh", "-c", f"sleep 4; kill -CONT {os.getpid()}"], start_new_session=True)
                os.kill(os.getpid(), signal.SIGSTOP)  # here, before call 5: the others wait in it (a timer
                # of a few ms let fast shm calls finish all 30 first, and nothing was tested)
            if i == 5 and mode == "kill" and rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # before call 5, as for stop: a timer let all 30
                # calls finish first on a fast machine, and the survivors had nothing to report
            x = np.full(5000, float(rank + i), np.float32)
            want = np.full(5000, float(sum(r + i for r in range(size))), np.float32)
            attempt(i, lambda x=x: dist.all_reduce(x, timeout=2), want, x)
    elif mode.startswith("roots-"):
        op = mode.removeprefix("roots-")
        x = np.full(1000, float(rank), np.float32)
        if op == "broadcast":
            attempt(0, lambda: dist.broadcast(x, src=rank, timeout=10))
        elif op == "reduce":
            attempt(0, lambda: dist.reduce(x, dst=rank, timeout=10))
        elif op == "gather":
            attempt(0, lambda: dist.gather(x, np.empty(1000 * size, np.float32), dst=rank, timeout=10))
        else:
            attempt(0, lambda: dist.scatter(x, np.zeros(1000 * size, np.float32), src=rank, timeout=10))
    elif mode == "barrier":
        x = np.ones(10, np.float32)
        attempt(0, (lambda: dist.barrier(timeout=10)) if rank == 0 else (lambda: dist.all_reduce(x, timeout=10)))
    log.close()
    time.sleep(0.5)  # leave after the others have read this rank's notices
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
