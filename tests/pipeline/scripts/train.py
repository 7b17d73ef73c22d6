"""Run under `ferrodist run -n N`: pipeline training in real processes, compared with the
unsplit model in one process (computed here too). Prints one JSON line per rank.

usage: train.py BACKEND SCHEDULE          (2 ranks: one pipeline of 2 stages)
       train.py BACKEND SCHEDULE hybrid   (4 ranks: 2 pipelines x 2 stages, DDP across)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))
from _pipe import hybrid_training, make_data, make_model, reference_training, stage_names

import ferrodist.collectives as dist
from ferrodist.nn import SGD, CrossEntropyLoss
from ferrodist.pipeline import GPipe, Interleaved1F1B, OneFOneB, Pipeline, ZeroBubbleH1, split_sequential

backend, name = sys.argv[1], sys.argv[2]
hybrid = len(sys.argv) > 3 and sys.argv[3] == "hybrid"
schedule = {"gpipe": GPipe(), "1f1b": OneFOneB(), "interleaved": Interleaved1F1B(2), "zb": ZeroBubbleH1()}[name]
world = dist.init_process_group(backend, timeout=60)
x, y = make_data(12, seed=5)
steps = 3
expected = reference_training(x, y, steps)
if hybrid:
    state = hybrid_training(world, dist.new_group, x, y, steps, schedule, 3)
else:
    p, rank = world.size, world.rank
    total = p * schedule.chunks
    stages = split_sequential(make_model(), total)
    mine = [stages[c * p + rank] for c in range(schedule.chunks)]
    pipe = Pipeline(mine, None, 4, schedule)
    opt = SGD([q for s in mine for q in s.parameters()], lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        pipe.train_step(x if rank == 0 else None, y if rank == p - 1 else None, CrossEntropyLoss())
        opt.step()
    names = stage_names(total)
    state = {names[c * p + rank][n]: q.data.copy() for c, s in enumerate(mine) for n, q in s.named_parameters()}
difference = max(float(np.max(np.abs(v - expected[k]))) for k, v in state.items())
print(json.dumps({"rank": world.rank, "size": world.size, "difference": difference, "ok": difference <= 1e-10}))
dist.destroy_process_group()
