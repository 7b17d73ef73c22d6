"""Elastic chaos: random trainings under ``ferrodist.elastic.run`` with random faults during
the steps and during the recoveries, in real processes.

A schedule (``make_schedule(seed)``, all drawn from the seed): 2 to 4 ranks, shm or tcp,
started by hand or by ``ferrodist run -n MIN:MAX`` (4 ranks: also by two launchers of two
nodes on this host, ``--nnodes 2 -n 1:2``, over the two levels, the second fault on the
other node than the first), 8 to 16 steps of an all_reduce (taking
no time besides, or 0.15 s: time for a replacement to join) with a commit every 2 to 4 steps (scripts/elastic_chaos.py), and one or two faults: a kill (at a
step, or as the rank enters the shrink of a recovery), a stop past the timeout and the
shrink's window (at a step or in the shrink), a stop under the timeout, a slow rank, or an
exception of the rank's own.

``run_schedule`` runs it and returns the violations of the invariant:

- no step returns a wrong value (each is checked against the members of its group);
- the survivors agree: every rank that finished holds the same members and, to the bit,
  the same total, which is the sum of each step's values over the members of the group
  that last did that step; every recovery made the same group on every rank that logged it;
- under ``ferrodist run -n 1:N`` the launcher starts a replacement for each rank lost, which
  joins at a commit point: a rank's last process is the one judged; a killed rank's
  replacement that a group took in (grew with, after the kill) joined it;
- a rank is in that final group, or was killed, or raised its own exception, or was told
  it is out (``Excluded``, naming a group the others made: that one, or one a join grew
  later), or found no majority (``Excluded`` with no group, only where no rank finished); a
  killed rank is never in it, and a harmless fault (a short stop, a slow rank) leaves
  every rank in it with no recovery at all;
- every recovery ends within the shrink's deadline plus ``SLACK``; the job ends within
  ``JOB_LIMIT``; no process outlives it and no ``/dev/shm/ferrodist-*`` file is left.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from chaos import _free_port, run_job

SCRIPT = Path(__file__).parent / "scripts" / "elastic_chaos.py"
TIMEOUT = 1.5  # the group's timeout
WINDOW = 0.5  # the shrink's window
SHRINK_TIMEOUT = 8.0
SLACK = 1.0
JOB_LIMIT = 90.0
KINDS = ("kill", "kill", "kill-in-shrink", "stop", "stop-in-shrink", "stop-short", "slow", "raise")


def value(step: int, rank: int) -> float:
    return float(step * 1000 + rank + 1)


def make_schedule(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ranks = rng.choice((2, 3, 3, 4, 4))
    steps = rng.randint(8, 16)
    kind = rng.choice(KINDS)
    first = {"rank": rng.randrange(ranks), "step": rng.randrange(1, steps - 1), "seconds": 0.0}
    faults = []
    if kind in ("kill-in-shrink", "stop-in-shrink"):
        # a kill at a step starts a recovery; a second rank fails as it enters the shrink
        faults.append({**first, "kind": "kill"})
        other = rng.choice([r for r in range(ranks) if r != first["rank"]])
        late = "kill" if kind == "kill-in-shrink" else "stop"
        faults.append({"rank": other, "step": -1, "in_shrink": True, "kind": late, "seconds": 0.0})
    else:
        faults.append({**first, "kind": kind})
    for fault in faults:
        if fault["kind"] == "stop":
            fault["seconds"] = round(TIMEOUT + 3 * WINDOW + rng.uniform(0.5, 2.0), 2)
        elif fault["kind"] in ("stop-short", "slow"):
            fault["kind"] = "stop" if fault["kind"] == "stop-short" else "slow"
            fault["seconds"] = round(rng.uniform(0.1, 0.4), 2)
            fault["harmless"] = True
    schedule = {
        "seed": seed,
        "ranks": ranks,
        "backend": rng.choice(("shm", "tcp")),
        "launch": rng.choice(("hand", "run")),
        "steps": steps,
        "every": rng.randint(2, 4),
        "n": rng.choice((1, 1000, 70_000)),
        "timeout": TIMEOUT,
        "window": WINDOW,
        "shrink_timeout": SHRINK_TIMEOUT,
        "faults": faults,
        "kind": kind,
        # seconds a step takes besides its call: time for a replacement (under ``run``) to join
        "pace": rng.choice((0.0, 0.15)),
    }
    # drawn last, so that the schedules drawn before the two nodes' were added stay as they were
    if ranks == 4 and schedule["launch"] == "run" and rng.random() < 0.5:
        # each node (ranks 0-1, 2-3) may lose one rank at a time: the second fault on the other one
        schedule.update(launch="nodes", backend="levels")
        for fault in faults[1:]:
            if fault["rank"] // 2 == faults[0]["rank"] // 2:
                fault["rank"] = (fault["rank"] + 2) % 4
    return schedule


def _start(schedule: dict[str, Any], outdir: Path) -> list[subprocess.Popen[bytes]]:
    spec, n = json.dumps(schedule), schedule["ranks"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": open(outdir / "stderr.txt", "wb")}
    if schedule["launch"] == "run":
        command = [sys.executable, "-m", "ferrodist.launch", "run", "-n", f"1:{n}", "--grace", "3"]
        return [subprocess.Popen([*command, str(SCRIPT), spec, str(outdir)], **quiet)]  # type: ignore[call-overload]
    if schedule["launch"] == "nodes":
        command = [sys.executable, "-m", "ferrodist.launch", "run", "--nnodes", "2", "--master-port", str(_free_port())]
        command += ["-n", "1:2", "--grace", "3"]
        env = dict(os.environ, FERRODIST_TOKEN=secrets.token_hex(16))
        return [
            subprocess.Popen([*command, "--node-rank", str(k), str(SCRIPT), spec, str(outdir)], env=env, **quiet)  # type: ignore[call-overload]
            for k in (0, 1)
        ]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n))
    return [
        subprocess.Popen([sys.executable, str(SCRIPT), spec, str(outdir)], env=dict(env, RANK=str(r)), **quiet)  # type: ignore[call-overload]
        for r in range(n)
    ]


def run_schedule(schedule: dict[str, Any], outdir: Path) -> list[str]:
    """Run one schedule; the invariant's violations (empty: none), each with the load."""
    return run_job(schedule, outdir, _start, check_logs, JOB_LIMIT)


def check_logs(schedule: dict[str, Any], outdir: Path) -> list[str]:
    seed, violations = schedule["seed"], []
    logs: dict[int, list[dict[str, Any]]] = {}
    for rank in range(schedule["ranks"]):
        path = outdir / f"rank{rank}.jsonl"
        logs[rank] = (
            [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        )
    # A rank's last process decides its outcome: a replacement appends after the one it replaced.
    outcome = {rank: ([e for e in entries if "outcome" in e] or [None])[-1] for rank, entries in logs.items()}
    last = {
        rank: max([i for i, e in enumerate(entries) if "joined" in e], default=-1) for rank, entries in logs.items()
    }
    killed = {
        rank for rank, entries in logs.items() if any(e.get("fault") == "kill" for e in entries[last[rank] + 1 :])
    }
    harmless = all(fault.get("harmless") for fault in schedule["faults"])
    for rank, entries in logs.items():  # a killed rank back in a group: its replacement joined it
        kills = [e["t"] for e in entries if e.get("fault") == "kill"]
        if not kills:
            continue
        back = [e["t"] for others in logs.values() for e in others if rank in e.get("grew", ()) and e["t"] > kills[-1]]
        if back and not any("joined" in e and e["t"] > kills[-1] for e in entries):
            violations.append(f"seed {seed}: the others took rank {rank}'s replacement in, but it never joined")
    for rank, entries in logs.items():
        for entry in entries:
            if "step" in entry and not entry["ok"]:
                violations.append(f"seed {seed}: rank {rank}, step {entry['step']} on {entry['members']}: WRONG RESULT")
            if entry.get("recovery") and entry["seconds"] > SHRINK_TIMEOUT + 2 * TIMEOUT + SLACK:
                violations.append(f"seed {seed}: rank {rank}'s recovery took {entry['seconds']:.1f} s")
    done = {rank: e for rank, e in outcome.items() if e is not None and e["outcome"] == "done"}
    finals = {tuple(e["members"]) for e in done.values()}
    if len(finals) > 1:
        violations.append(f"seed {seed}: the ranks that finished hold different groups: {sorted(finals)}")
    final = next(iter(finals)) if finals else None
    if done:
        totals = {tuple(e["total"]) for e in done.values()}
        if len(totals) > 1:
            violations.append(f"seed {seed}: the ranks that finished hold different totals")
        some = max(done, key=lambda rank: sum("step" in e for e in logs[rank]))  # one that trained throughout
        done_by: dict[int, list[int]] = {}
        for entry in logs[some]:
            if "step" in entry:
                done_by[entry["step"]] = entry["members"]
        want = sum(value(step, r) for step, members in done_by.items() for r in members)
        got = next(iter(done.values()))["total"][0]
        if sorted(done_by) != list(range(schedule["steps"])) or got != want:
            violations.append(f"seed {seed}: the total {got} is not the replay of the steps' members ({want})")
    recoveries: dict[int, set[tuple[int, ...]]] = {}
    for rank, entries in logs.items():
        if last[rank] >= 0:
            continue  # a replacement's recoveries are counted from its joining, not from the start
        for k, entry in enumerate(e for e in entries if e.get("recovery")):
            recoveries.setdefault(k, set()).add(tuple(entry["members"]))
    for k, groups in recoveries.items():
        if len(groups) > 1:
            violations.append(f"seed {seed}: recovery {k} made different groups on different ranks: {sorted(groups)}")
    for rank in range(schedule["ranks"]):
        end = outcome[rank]
        if final is not None and rank in final:
            if rank not in done:
                violations.append(f"seed {seed}: rank {rank} is in the final group {final} but ended with {end}")
            if rank in killed:
                violations.append(f"seed {seed}: the killed rank {rank} is in the final group {final}")
        elif rank in killed:
            continue
        elif end is None:
            violations.append(f"seed {seed}: rank {rank} left no outcome (it crashed or hung)")
        elif end["outcome"] == "raised":
            continue
        elif end["outcome"] == "excluded":
            made = {final, *(g for groups in recoveries.values() for g in groups)}  # a later join may grow it
            if end["survivors"] and final is not None and tuple(end["survivors"]) not in made:
                violations.append(
                    f"seed {seed}: rank {rank} was told of group {end['survivors']}, none the others made"
                )
            if not end["survivors"] and final is not None and rank in final:
                violations.append(f"seed {seed}: rank {rank} found no majority but is in the final group")
        else:
            violations.append(f"seed {seed}: rank {rank} is outside the final group {final} and ended with {end}")
    if harmless:
        if final != tuple(range(schedule["ranks"])):
            violations.append(f"seed {seed}: a harmless fault, but the final group is {final} ({outcome})")
        if recoveries:
            violations.append(f"seed {seed}: a harmless fault caused a recovery")
    return violations
