"""Run by tests/integration/test_shrink.py: a job that loses a rank and goes on shrunk.

    shrink.py MODE OUTDIR BACKEND VICTIMS

40 steps of an all_reduce of values chosen by (step, global rank), each checked exactly
against the members of the group it ran on. Before step 10, each rank of VICTIMS (e.g. 2 or 1,2):
MODE kill:   kills itself (SIGKILL);
MODE stop:   stops itself (SIGSTOP) for 6 s, past the group's 2 s timeout and the
             shrink's window, then goes on: its next call fails, and so does its shrink
             (``Excluded``): the others went on without it.
The survivors catch the failure, shrink the group and go on from the step that failed.
Each rank writes OUTDIR/rank{R}.json: its outcome, the members of its last group, the
wall-clock time it finished the step after the failure, and the wrong values it saw.
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
from ferrodist.core import Excluded, FerrodistError

STEPS, LOST_AT = 40, 10


def main() -> None:
    mode, outdir, backend = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    victims = {int(v) for v in sys.argv[4].split(",")}
    group = dist.init_process_group(backend, timeout=2)
    rank = group.rank
    result: dict[str, object] = {"rank": rank, "wrong": []}
    step = 0
    while step < STEPS:
        if step == LOST_AT and rank in victims:
            (outdir / "lost_at").write_text(repr(time.time()))
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            subprocess.Popen(["sh", "-c", f"sleep 6; kill -CONT {os.getpid()}"], start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        x = np.full(1000, float(step * 1000 + rank + 1))
        try:
            group.all_reduce(x)
        except FerrodistError as exc:
            result.setdefault("failure", f"{type(exc).__name__}: {exc}")
            try:
                group = group.shrink(timeout=30, window=1.0)
            except Excluded as out:
                result.update(outcome="excluded", survivors=list(out.survivors), message=str(out))
                break
            result["shrunk_to"] = list(group.ranks)
            continue  # the same step again, on the new group
        want = float(sum(step * 1000 + r + 1 for r in group.ranks))
        if not np.all(x == want):
            result["wrong"].append([step, float(x[0]), want])  # type: ignore[union-attr]
        if "shrunk_to" in result and "recovered" not in result:
            result["recovered"] = time.time()
        step += 1
    else:
        result.update(outcome="done", ranks=list(group.ranks))
    (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group() if result.get("outcome") == "done" else group.transport.close()


if __name__ == "__main__":
    main()
