"""Run by tests/elastic/test_pipeline.py under ``ferrodist run -n 3:4``: two pipelines of two
stages (ranks 0-1 and 2-3), each stage's two replicas averaged by DDP, under
``ferrodist.elastic.run`` with a commit every 5 steps and the stage as each rank's role.
Rank 3 (pipeline 1's last stage) kills itself at step 13. Rank 2, whose pipeline lost its
other stage, stands by at each commit point; pipeline 0 trains on alone from the commit of
step 10. The launcher's replacement for rank 3 joins at a commit point and gets stage 1's
commit from rank 1, rank 2 gets stage 0's newest from rank 0, and both pipelines train on.

    pipeline.py OUTDIR [PIPELINES]

With PIPELINES 1 (``ferrodist run -n 1:2``): one pipeline of two stages, no replicas, and
``State(backup=True)``: rank 0 is left alone when rank 1 is lost, stands by until the
replacement joins, and the replacement gets stage 1's commit from the copy rank 0 kept.

Each rank writes OUTDIR/rank{R}-{pid}.json: the step and members of each call of ``train``,
its stage's final parameters, and (rank 0) the pipelines each step was last trained by.
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
from ferrodist.pipeline import OneFOneB, Pipeline, split_sequential

STEPS, EVERY, LOST_AT = 40, 5, 13


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 8, rng=1), nn.Tanh(), nn.Linear(8, 8, rng=2), nn.Tanh(), nn.Linear(8, 2, rng=3))


def batch(step: int, line: int) -> tuple[np.ndarray, np.ndarray]:
    """Pipeline ``line``'s batch of step ``step`` (chosen by the two alone)."""
    rng = np.random.default_rng([step, line])
    return rng.normal(size=(6, 3)), rng.normal(size=(6, 2))


def main() -> None:
    outdir, pipelines = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2
    world = dist.init_process_group("auto", timeout=10)
    me = world.global_rank
    line, index = divmod(me, 2)  # which pipeline, which stage
    stage = split_sequential(model(), 2)[index]
    opt = nn.SGD(stage.parameters(), lr=0.05)
    state = State(model=stage, optimizer=opt, step=0, role=lambda rank: rank % 2, backup=pipelines == 1)
    victim = 2 * pipelines - 1  # the last stage of the last pipeline
    calls: list[list] = []
    trained: dict[int, list[int]] = {}  # step -> the pipelines that trained it (the last time)

    def train(s: State) -> None:
        group = s.group
        lines = [k for k in range(pipelines) if {2 * k, 2 * k + 1} <= set(group.ranks)]
        calls.append([s.step, list(group.ranks)])
        if not lines:  # no pipeline is whole: wait for the replacement (Regrouped)
            s.stand_by(wait=30)
            raise RuntimeError(f"rank {me}: no replacement joined within 30 s")
        if line not in lines:  # the other stage of this pipeline is lost: keep the place
            while s.step < STEPS:
                s.step += 1
                if s.step % EVERY == 0:
                    s.stand_by()
            return
        pipe = Pipeline(stage, group.subgroup([2 * line, 2 * line + 1], name=f"{group.name}/pipe{line}"), 2, OneFOneB())
        replicas = group.subgroup([2 * k + index for k in lines], name=f"{group.name}/stage{index}")
        ddp = DDP(stage, group=replicas)
        while s.step < STEPS:
            if me == victim and s.step == LOST_AT and not dist.is_replacement():
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(s.step, line)
            opt.zero_grad()
            pipe.train_step(x if index == 0 else None, y if index == 1 else None, nn.MSELoss())
            ddp.sync_gradients()
            opt.step()
            trained[s.step] = lines
            time.sleep(0.08)  # a step that takes a while: the replacement joins in the middle
            s.step += 1
            if s.step % EVERY == 0:
                s.commit()

    run(train, state)
    record = {
        "calls": calls,
        "replacement": dist.is_replacement(),
        "ranks": list(state.group.ranks),
        "params": [p.data.tolist() for p in stage.parameters()],
        "trained": trained,
    }
    (outdir / f"rank{me}-{os.getpid()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
