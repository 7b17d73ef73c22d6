"""Run by tests/integration/test_shrink.py under ``ferrodist run -n 3:4``: DDP training
under ``ferrodist.elastic.run``; rank 3 kills itself at step 13, the others shrink and go
on, and the launcher's replacement for rank 3 joins at a commit point and trains on.

    grow.py OUTDIR

Each rank (the replacement too) writes OUTDIR/rank{R}-{pid}.json: the steps and groups it
trained from, how many seconds after its process started it first trained, whether it is
the replacement, and the final parameters' bytes (hex) for the check that all agree.
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
from ferrodist import nn
from ferrodist.ddp import DDP
from ferrodist.elastic import State, run


def _age() -> float:
    """Seconds since this process started (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def main() -> None:
    outdir = Path(sys.argv[1])
    dist.init_process_group("auto", timeout=10)
    net = nn.Sequential(nn.Linear(3, 16, rng=1), nn.Tanh(), nn.Linear(16, 1, rng=2))
    opt = nn.SGD(net.parameters(), lr=0.05)
    state = State(model=net, optimizer=opt, step=0)
    calls: list[list] = []

    def train(s: State) -> None:
        group = s.group
        model, loss_fn = DDP(net, group), nn.MSELoss()
        calls.append([s.step, list(group.ranks), round(_age(), 2)])
        while s.step < 60:
            if group.global_rank == 3 and s.step == 13 and not dist.is_replacement():
                os.kill(os.getpid(), signal.SIGKILL)
            rng = np.random.default_rng([s.step, group.rank, group.size])
            x = rng.normal(size=(8, 3))
            loss_fn(model(x), x.sum(axis=1, keepdims=True))
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
            time.sleep(0.08)  # a step that takes a while: the replacement joins in the middle
            s.step += 1
            if s.step % 5 == 0:
                s.commit()

    run(train, state)
    params = b"".join(p.data.tobytes() for p in net.parameters()).hex()
    record = {"calls": calls, "replacement": dist.is_replacement(), "ranks": list(state.group.ranks), "params": params}
    (outdir / f"rank{state.group.global_rank}-{os.getpid()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
