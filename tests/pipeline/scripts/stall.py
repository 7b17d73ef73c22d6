"""One rank of a 4-stage pipeline whose rank 1 stops itself (SIGSTOP) in the second step;
each other rank writes the error it raised to OUTDIR/rank<R>.json.

usage: stall.py BACKEND OUTDIR      (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _pipe import make_data, make_model

import ferrodist.collectives as dist
from ferrodist.core import FerrodistError
from ferrodist.nn import CrossEntropyLoss
from ferrodist.pipeline import OneFOneB, Pipeline, split_sequential

backend, outdir = sys.argv[1], Path(sys.argv[2])
world = dist.init_process_group(backend, timeout=3)
p, rank = world.size, world.rank
x, y = make_data(12, seed=5)
pipe = Pipeline([split_sequential(make_model(), p)[rank]], None, 4, OneFOneB())
for step in range(2):
    if step == 1 and rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        pipe.train_step(x if rank == 0 else None, y if rank == p - 1 else None, CrossEntropyLoss())
    except FerrodistError as exc:
        record = {"class": type(exc).__name__, "message": str(exc), "waiting_for": list(exc.waiting_for)}
        (outdir / f"rank{rank}.json").write_text(json.dumps(record))
        sys.exit(1)
