"""Run by tests/integration/test_shm_arena.py, by hand (no launcher): `shm_arena.py MODE OUTDIR`
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, 2 ranks.

MODE ok:                  init the shm backend, all_reduce, print "rank R ok".
MODE pause-after-create:  rank 0 stops for good right after it has made the arena (before
                          it publishes it) and writes OUTDIR/created: the moment a kill
                          used to leave a file in /dev/shm.
MODE late-peer:           as pause-after-create, and rank 1 waits for OUTDIR/go before it
                          reads the hosts of the job (its first read of the store), so
                          it meets rank 0's death there, before it asked for the arena.
MODE pause-before-attach: rank 1 got rank 0's address but waits for OUTDIR/go before it
                          opens the arena (writing OUTDIR/published first): the test kills
                          rank 0 in between.
A rank that catches a ferrodist error records it in OUTDIR/error<rank>.json (class,
message, peer, seconds since it started to join) and exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import FerrodistError
from ferrodist.transport._shm import transport as shm_transport
from ferrodist.transport._shm.arena import Arena
from ferrodist.transport._start.rendezvous import Rendezvous


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    patches = []
    if mode in ("pause-after-create", "late-peer") and rank == 0:
        create = Arena.create

        def create_then_stop(*args: object, **kwargs: object) -> Arena:
            arena = create(*args, **kwargs)  # type: ignore[arg-type]
            (outdir / "created").write_text(str(os.getpid()))
            time.sleep(60)
            return arena

        patches.append(mock.patch.object(Arena, "create", create_then_stop))
    if mode == "pause-before-attach" and rank == 1:
        open_segment = shm_transport.open_segment

        def wait_then_open(address: str, size: int) -> int:
            (outdir / "published").write_text(address)
            give_up = time.monotonic() + 30
            while not (outdir / "go").exists() and time.monotonic() < give_up:
                time.sleep(0.01)
            return open_segment(address, size)

        patches.append(mock.patch.object(shm_transport, "open_segment", wait_then_open))
    if mode == "late-peer" and rank == 1:
        get = Rendezvous.get

        def late_get(self: Rendezvous, key: str, *args: object) -> bytes:
            while key.startswith("ferrodist/shm/host/") and not (outdir / "go").exists():
                time.sleep(0.01)
            return get(self, key, *args)  # type: ignore[arg-type]

        patches.append(mock.patch.object(Rendezvous, "get", late_get))
    for patch in patches:
        patch.start()
    start = time.monotonic()
    try:
        dist.init_process_group("shm", timeout=20)
        x = np.full(4, rank + 1.0)
        dist.all_reduce(x)
        assert x.tolist() == [3.0] * 4, x
    except FerrodistError as exc:
        record = {
            "class": type(exc).__name__,
            "message": str(exc),
            "peer": getattr(exc, "peer", None),
            "seconds": time.monotonic() - start,
        }
        (outdir / f"error{rank}.json").write_text(json.dumps(record))
        sys.exit(1)
    print(f"rank {rank} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
