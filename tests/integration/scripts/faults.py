"""Run by tests/integration/test_real_processes.py as `ferrodist run -n 3 faults.py MODE OUTDIR [BACKEND]`
(or under mpiexec with BACKEND mpi).

MODE kill:     rank 1 kills itself with SIGKILL in the middle of a large all_reduce.
MODE skip:     rank 2 never calls the all_reduce the others are in.
MODE mismatch: rank 1 all_reduces a different number of elements than the others
(mismatch-large: the same with 4 MiB, which shm moves in many chunks).
Every rank records its pid; a rank that catches a ferrodist error records it as JSON
(class, message, attributes, seconds it took) and exits 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import FerrodistError


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "tcp"
    dist.init_process_group(backend, timeout=60)
    rank = dist.get_rank()
    (outdir / f"pid{rank}").write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # survivors report, then leave by themselves
    x = np.ones({"kill": 16 << 20, "mismatch-large": 1 << 20}.get(mode, 1000), np.float32)
    dist.all_reduce(x[:10])  # everyone is connected and in step
    if mode == "kill" and rank == 1:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if mode == "skip" and rank == dist.get_world_size() - 1:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(4 if backend == "mpi" else 60)  # under mpiexec: come back, so MPI can finish
        return
    if mode.startswith("mismatch") and rank == 1:
        x = x[: x.size - 1]
    # Over tcp force the ring (its neighbours are known); over shm use the arena.
    algorithm = "ring" if backend == "tcp" else None
    start = time.monotonic()
    try:
        for _ in range(50 if mode == "kill" else 1):
            dist.all_reduce(x, algorithm=algorithm, timeout=2.0 if mode == "skip" else 30.0)
    except FerrodistError as exc:
        record = {
            "class": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
            "peer": getattr(exc, "peer", None),
            "waiting_for": list(getattr(exc, "waiting_for", ())),
        }
        (outdir / f"error{rank}.json").write_text(json.dumps(record))
        # Stay a moment: rank 0 hosts the store the others' timeout census uses, and a
        # survivor that left at once would be the next thing its peers report.
        time.sleep(1.5)
        sys.exit(1)
    (outdir / f"finished{rank}").write_text("")


if __name__ == "__main__":
    main()
