"""Run under `ferrodist run -n 2 [--max-restarts N]`: DDP training that saves a checkpoint
every EVERY steps and resumes from the last one when it starts again. On the first start
only (FERRODIST_RESTART_COUNT=0), rank 1 kills itself (SIGKILL) at step KILL (-1: never),
or, with WHAT = launcher, kills its launcher first (a lost node).
The data of a step depends on the step and the rank only, so a resumed run sees what an
uninterrupted one sees. Prints one JSON line per rank: where it started, the restart count
and the final parameters.

usage: resumable.py CHECKPOINT STEPS EVERY KILL [WHAT]
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

import ferrodist.collectives as dist
from ferrodist import nn
from ferrodist.ddp import DDP, resume_checkpoint, save_checkpoint

checkpoint, steps, every, kill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
launcher = sys.argv[5:] == ["launcher"]
restart = int(os.environ["FERRODIST_RESTART_COUNT"])
group = dist.init_process_group(timeout=30)
model = DDP(nn.Sequential(nn.Linear(4, 16, rng=0), nn.Tanh(), nn.Linear(16, 1, rng=1)))
opt = nn.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.MSELoss()
start = resume_checkpoint(checkpoint, model, opt) or 0
for step in range(start, steps):
    if step == kill and group.rank == 1 and restart == 0:
        if launcher:
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)  # at once, as the node would go: no step after this one
    rng = np.random.default_rng(1000 * step + group.rank)
    x = rng.standard_normal((8, 4))
    opt.zero_grad()
    loss_fn(model(x), np.sin(x).sum(axis=1, keepdims=True))
    model.backward(loss_fn.backward())
    opt.step()
    if (step + 1) % every == 0:
        save_checkpoint(checkpoint, model, opt, extra=step + 1)
params = [p.data.ravel().tolist() for p in model.parameters()]
print(json.dumps({"rank": group.rank, "restart": restart, "start": start, "params": params}), flush=True)
dist.destroy_process_group()
