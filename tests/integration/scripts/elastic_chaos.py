"""One rank of an elastic chaos schedule (tests/integration/elastic_chaos.py):

    elastic_chaos.py SPEC OUTDIR

``ferrodist.elastic.run`` over a training of ``steps`` steps: each step all_reduces values
chosen by (step, global rank), checks the result against the members of the group it ran
on, and adds it to the state's total; a commit every ``every`` steps. The faults of the
spec strike at their step, in the processes the job started with (a replacement that
``ferrodist run -n 1:N`` starts for a lost rank joins at a commit and trains on): kill, stop (SIGSTOP for ``seconds``), slow
(a sleep before the call), raise (an exception of the rank's own), or, with ``in_shrink``,
as the rank enters its shrink. Each rank appends to OUTDIR/rank{R}.jsonl: one line per step
done (its members, whether the result was right), one per recovery (the new members and
how long it took), one per group grown with replacements (its members), a replacement's
line when it joined, and the outcome: done (the final
members and total), excluded (the survivors it was told of), or error.
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
from ferrodist.collectives import ProcessGroup
from ferrodist.core import Excluded, FerrodistError
from ferrodist.elastic import State, run


def value(step: int, rank: int) -> float:
    return float(step * 1000 + rank + 1)


def main() -> int:
    spec, outdir = json.loads(sys.argv[1]), Path(sys.argv[2])
    world = dist.init_process_group(spec["backend"], timeout=spec["timeout"])
    me = world.global_rank  # a replacement's group rank may differ
    (outdir / f"pid{me}").write_text(str(os.getpid()))
    log = open(outdir / f"rank{me}.jsonl", "a", buffering=1)  # a replacement (ferrodist run -n 1:N) appends
    struck: set[int] = set()
    # The faults strike the processes the job started with; a replacement joins and trains.
    mine = [] if dist.is_replacement() else [i for i, f in enumerate(spec["faults"]) if f["rank"] == me]
    if dist.is_replacement():
        log.write(json.dumps({"joined": list(world.ranks), "t": time.time()}) + "\n")

    def strike(i: int) -> None:
        fault = spec["faults"][i]
        struck.add(i)
        log.write(json.dumps({"fault": fault["kind"], "t": time.time()}) + "\n")
        if fault["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault["kind"] == "stop":
            subprocess.Popen(
                ["sh", "-c", f"sleep {fault['seconds']}; kill -CONT {os.getpid()}"], start_new_session=True
            )
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault["kind"] == "slow":
            time.sleep(fault["seconds"])
        elif fault["kind"] == "raise":
            raise RuntimeError(f"rank {me}: a bug of its own at step {fault['step']}")

    shrink = ProcessGroup.shrink

    def shrinking(group: ProcessGroup, **options):  # the faults that strike in a shrink
        for i in mine:
            if spec["faults"][i].get("in_shrink") and i not in struck:
                strike(i)
        return shrink(group, **options)

    ProcessGroup.shrink = shrinking  # type: ignore[method-assign]
    grow = ProcessGroup.grow

    def growing(group: ProcessGroup, joiners, **options):  # the members that took replacements in
        grown = grow(group, joiners, **options)
        log.write(json.dumps({"grew": list(grown.ranks), "t": time.time()}) + "\n")
        return grown

    ProcessGroup.grow = growing  # type: ignore[method-assign]

    state = State(world, total=np.zeros(spec["n"]), step=0)
    failed_at = [time.monotonic()]

    def train(s: State) -> None:
        while s.step < spec["steps"]:
            group = s.group
            for i in mine:
                fault = spec["faults"][i]
                if fault["step"] == s.step and not fault.get("in_shrink") and i not in struck:
                    strike(i)
            time.sleep(spec["pace"])
            x = np.full(spec["n"], value(s.step, me))
            started = time.monotonic()
            try:
                group.all_reduce(x)
            except FerrodistError:
                failed_at[0] = time.monotonic()
                raise
            want = sum(value(s.step, r) for r in group.ranks)
            right = bool(np.all(x == want))
            entry = {"step": s.step, "members": list(group.ranks), "ok": right, "seconds": time.monotonic() - started}
            log.write(json.dumps(entry) + "\n")
            s.total = s.total + x
            s.step += 1
            if s.step % spec["every"] == 0:
                s.commit()

    def recovered(s: State, error: FerrodistError) -> None:
        took = time.monotonic() - failed_at[0]  # from the failure to a new group, synced
        log.write(json.dumps({"recovery": True, "members": list(s.group.ranks), "seconds": took}) + "\n")

    try:
        run(train, state, timeout=spec["shrink_timeout"], window=spec["window"], on_recovery=recovered)
    except Excluded as exc:
        log.write(json.dumps({"outcome": "excluded", "survivors": list(exc.survivors), "message": str(exc)}) + "\n")
        os._exit(3)
    except FerrodistError as exc:
        log.write(json.dumps({"outcome": "error", "cls": type(exc).__name__, "message": str(exc)}) + "\n")
        os._exit(1)
    except RuntimeError as exc:  # the fault "raise": this rank's own bug ends it
        log.write(json.dumps({"outcome": "raised", "message": str(exc)}) + "\n")
        os._exit(4)
    log.write(json.dumps({"outcome": "done", "members": list(state.group.ranks), "total": state.total.tolist()}) + "\n")
    log.close()
    state.group.transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
