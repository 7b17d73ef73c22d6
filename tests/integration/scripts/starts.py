"""Run by tests/integration/test_starts.py, under `ferrodist run` or as processes started
by hand with their own RANK and WORLD_SIZE: `starts.py MODE OUTDIR BACKEND [COUNT]`.

MODE join:    init_process_group with the default timeout (300 s), then one checked all_reduce.
MODE twice:   init_process_group, then init_process_group again.
MODE reinit:  COUNT times: init_process_group, a checked all_reduce, destroy_process_group
              (rank 0 dawdles before every other destroy, so that the others come back
              while its previous store is still up).
MODE work:    init_process_group, then COUNT checked all_reduces, a millisecond apart.
MODE freeze:  after a first all_reduce rank 0 stops itself (SIGSTOP) and rank 1 runs
              all_reduce(timeout=5).

A rank that catches a ferrodist error writes it to OUTDIR/error<pid>.json (class, message,
seconds since the start of the call that raised, and RANK), waits a second (so that, under
the launcher, the others can record theirs before it stops them) and exits 1; a rank that
finishes writes OUTDIR/done<pid>.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import FerrodistError


def checked_all_reduce(round_: int) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    x = np.array([rank + 1.0, round_], np.float64)
    dist.all_reduce(x)
    expected = [size * (size + 1) / 2, size * round_]
    if x.tolist() != expected:
        raise SystemExit(f"rank {rank}: all_reduce gave {x.tolist()}, expected {expected}")


def main() -> None:
    mode, outdir, backend = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's SIGKILL after --grace still ends us
    start = time.monotonic()
    try:
        if mode == "join":
            dist.init_process_group(backend)
            checked_all_reduce(0)
        elif mode == "work":
            dist.init_process_group(backend)
            for round_ in range(count):
                checked_all_reduce(round_)
                time.sleep(0.001)
        elif mode == "twice":
            dist.init_process_group(backend, timeout=60)
            checked_all_reduce(0)
            start = time.monotonic()
            dist.init_process_group(backend, timeout=60)
        elif mode == "reinit":
            for round_ in range(count):
                dist.init_process_group(backend, timeout=30)
                checked_all_reduce(round_)
                if dist.get_rank() == 0 and round_ % 2:
                    time.sleep(0.3)
                dist.destroy_process_group()
            print(f"rank {os.environ['RANK']}: {count} rounds of init, all_reduce, destroy passed over {backend}")
        elif mode == "freeze":
            dist.init_process_group(backend, timeout=60)
            checked_all_reduce(0)
            if dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(0.5)  # rank 0 is stopped by now
                start = time.monotonic()
                dist.all_reduce(np.ones(4), timeout=5)
        else:
            raise SystemExit(f"unknown mode {mode}")
    except FerrodistError as exc:
        record = {
            "class": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
            "rank": int(os.environ["RANK"]),
        }
        (outdir / f"error{os.getpid()}.json").write_text(json.dumps(record))
        time.sleep(1.0)  # under the launcher: the other ranks record theirs before it stops them
        sys.exit(1)
    (outdir / f"done{os.getpid()}").write_text("")


if __name__ == "__main__":
    main()
