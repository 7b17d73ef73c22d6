"""The chaos harness: random schedules of collectives under random faults, in real processes.

A schedule (``make_schedule(seed)``, all drawn from the seed) is: 2 to 4 ranks, the shm or
tcp backend, started by ``ferrodist run`` or by hand (each rank its own process with
MASTER_ADDR/RANK/WORLD_SIZE, as SLURM or mpiexec would), 8 to 16 collectives of every
kind on the world group or on subgroups (in one thread, or a thread per group), some
``async_op=True`` and in flight together, of 1 to 300000 elements (several
shared-memory chunks), and one fault: none, SIGKILL of
a rank (before or in the middle of a call), SIGSTOP past the deadline, SIGSTOP well
under it, an exception in a rank's own code, a delay under the deadline, a stranger
(connections to every port of the job that stay silent or speak something else, during
the start), or (by hand) a second process started as the same rank. About a third of the
schedules of 3 or 4 ranks run as two simulated nodes (ranks 0 and 1 on one, the rest on the
other, by the variables a launcher per node sets) over the ``levels`` backend: shared
memory inside each node, tcp between. A quarter of the
schedules also run on a cold cache: an empty ``NUMBA_CACHE_DIR`` of their own, so that
every kernel compiles in the background while the calls run their interpreted paths and
then switch, whatever the fault.

``run_schedule`` runs it (scripts/chaos.py on every rank) and returns the violations of
the invariant, checked on every rank:

- every call returns what numpy computes, or raises a ``FerrodistError`` within its
  deadline plus ``SLACK`` (for a call that waited behind others in flight: their
  deadlines too);
- a failure reaches every member of the group no later than its next call there: once a
  call of a group raised on some rank, every member that returned that very call (with
  the right result) raises at its next call on the group, and a rank that raised on a
  group raises on every later call there (the group stays aborted);
- with no fault, one that stays under the deadline, or a stranger, every call returns;
- after a kill, a long stop or an exception, the first error of every other rank that
  saw one names the faulty rank;
- a second process started as one of the ranks stops every process of the job (it comes
  within seconds of the start), each with an error naming the two processes: the second
  one and every rank still starting within 15 s, a rank that had started at its
  warm-up or its next call;
- no process outlives the job, and no ``/dev/shm/ferrodist-*`` file is left.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrodist.collectives._fingerprint import OPERATIONS  # every collective there is

SCRIPT = Path(__file__).parent / "scripts" / "chaos.py"
#: Seconds past a call's deadline within which it must have raised.
SLACK = 1.0
TIMEOUT = 2.0
#: Seconds a whole schedule may take before it counts as a hang.
JOB_LIMIT = 90.0
FAULTS = ("none", "none", "kill", "kill", "stop", "stop-short", "raise", "delay", "stranger", "duplicate")
#: Seconds within which every process of a bad start (a duplicate rank) must have given up.
BAD_START_LIMIT = 15.0


def make_schedule(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ranks = rng.choice((2, 2, 3, 3, 4))
    groups = {"all": list(range(ranks))}
    if ranks >= 3:
        groups["pair"] = sorted(rng.sample(range(ranks), 2))
    calls = []
    for _ in range(rng.randint(8, 16)):
        calls.append(
            {
                "op": rng.choice(OPERATIONS),
                "group": rng.choice(["world", "world", "world", *groups]),
                "dtype": rng.choice(("float32", "float64", "int32")),
                "n": rng.choice((1, 37, 1000, 1000, 300_000)),
                "root": rng.randrange(ranks),
                "async": rng.random() < 0.4,
                "flush": rng.random() < 0.2,
            }
        )
    kind = rng.choice(FAULTS)
    fault = {
        "kind": kind,
        "rank": rng.randrange(ranks),
        "at": rng.randrange(len(calls)),
        "after": rng.choice((0.0, 0.005, 0.05)),
        "seconds": {"stop": TIMEOUT + 1.5, "stop-short": 0.3, "delay": 0.3}.get(kind, 0.0),
    }
    schedule = {
        "seed": seed,
        "ranks": ranks,
        "backend": rng.choice(("shm", "tcp")),
        "launch": "hand" if kind == "duplicate" else rng.choice(("run", "hand")),
        "threads": rng.random() < 0.3,  # each group's calls in a thread of its own
        "timeout": TIMEOUT,
        "groups": groups,
        "calls": calls,
        "fault": fault,
        "cold": rng.random() < 0.25,  # drawn after the others: the draws above are those of earlier versions
    }
    if rng.random() < 0.3 and ranks >= 3:  # two simulated nodes (ranks 0-1 and the rest), started by hand
        schedule.update(backend="levels", launch="hand", nodes=True)
    return schedule


def shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("ferrodist-*")}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start(schedule: dict[str, Any], outdir: Path) -> list[subprocess.Popen[bytes]]:
    spec = json.dumps(schedule)
    n = schedule["ranks"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": open(outdir / "stderr.txt", "wb")}
    base = dict(os.environ)
    if schedule.get("cold"):
        base["NUMBA_CACHE_DIR"] = str(outdir / "empty-numba-cache")
    if schedule["launch"] == "run":
        command = [sys.executable, "-m", "ferrodist.launch", "run", "-n", str(n), "--grace", "3"]
        return [subprocess.Popen([*command, str(SCRIPT), spec, str(outdir)], env=base, **quiet)]
    port = _free_port()
    env = dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n))
    ranks = list(range(n))
    if schedule["fault"]["kind"] == "duplicate":  # a second process started as the same rank
        ranks.append(schedule["fault"]["rank"])
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), spec, str(outdir)], env=dict(env, RANK=str(r), **_place(schedule, r)), **quiet
        )
        for r in ranks
    ]


def _place(schedule: dict[str, Any], rank: int) -> dict[str, str]:
    """Where a rank started by hand says it runs: one node, or (``nodes``) ranks 0 and 1 on
    node 0 and the others on node 1, as a launcher per node would say."""
    if not schedule.get("nodes"):
        return {"LOCAL_RANK": str(rank)}
    return {"GROUP_RANK": str(min(rank // 2, 1)), "LOCAL_RANK": str(rank if rank < 2 else rank - 2)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def load() -> float:
    """The machine's load: runnable processes, averaged over the last minute."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def runnable() -> int:
    """Threads runnable right now, this process's included (the load's source, without its lag)."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])


class Hog:
    """``count`` processes that keep a core busy each (at ``nice``), for the time of a
    ``with`` block: a crowded machine, as a shared CI runner or cluster node is."""

    def __init__(self, count: int, nice: int = 0) -> None:
        self.count, self.nice = count, nice
        self._processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Hog:
        # Each busy process checks now and then that the test still runs (a killed test run
        # leaves none behind).
        spin = (
            f"import os; os.nice({self.nice}); parent = os.getppid()\n"
            "while os.getppid() == parent:\n    for _ in range(200000): pass"
        )
        self._processes = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self._processes:
            process.kill()
        for process in self._processes:
            process.wait()


def hog_from_environment() -> Hog:
    """``FERRODIST_CHAOS_HOG`` busy processes (default 0: none)."""
    return Hog(int(os.environ.get("FERRODIST_CHAOS_HOG", "0") or 0))


def run_schedule(schedule: dict[str, Any], outdir: Path) -> list[str]:
    """Run one schedule; the invariant's violations, as sentences (empty: none), each with
    the machine's load when the schedule started (``schedule["load"]`` says it too)."""
    return run_job(schedule, outdir, _start, check_logs, JOB_LIMIT)


def run_job(
    schedule: dict[str, Any],
    outdir: Path,
    start: Callable[[dict[str, Any], Path], list[subprocess.Popen[bytes]]],
    check: Callable[[dict[str, Any], Path], list[str]],
    limit: float,
) -> list[str]:
    """Start a schedule's processes (``start``), wait for them up to ``limit`` seconds (a
    hang past it is a violation), kill what is left, then the violations: a rank that
    outlived the job (by its ``pid*`` file), a file left in /dev/shm, and ``check``'s."""
    outdir.mkdir(parents=True, exist_ok=True)
    before = shm_files()
    seed = schedule["seed"]
    schedule["load"], schedule["runnable"] = load(), runnable()
    processes = start(schedule, outdir)
    deadline = time.monotonic() + limit
    violations = []
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            violations.append(f"seed {seed}: the job was still running after {limit:g} s (a hang)")
            break
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
    time.sleep(0.2)  # let the kernel finish reaping ranks killed with their launcher
    for pid_file in outdir.glob("pid*"):
        pid = int(pid_file.read_text())
        if _alive(pid):
            violations.append(f"seed {seed}: rank {pid_file.name[3:]} (pid {pid}) outlived the job")
            os.kill(pid, signal.SIGKILL)
    left = shm_files() - before
    if left:
        violations.append(f"seed {seed}: files left in /dev/shm: {sorted(left)}")
    violations += check(schedule, outdir)
    said = f"[load {schedule['load']:.1f}, {schedule['runnable']} runnable at the start]"
    return [f"{violation} {said}" for violation in violations]


def check_duplicate(schedule: dict[str, Any], outdir: Path) -> tuple[list[str], set[int]]:
    """A second process started as one of the ranks: every process of the job must stop
    saying so (see the module docstring). Returns the violations and the ranks that stopped
    before their calls (their logs are not checked)."""
    seed, violations = schedule["seed"], []
    duplicated = schedule["fault"]["rank"]
    said = f"two processes were started as rank {duplicated} ("
    starts = [json.loads(p.read_text()) for p in outdir.glob("start-*.json")]
    for start in starts:
        if said not in start["message"]:
            violations.append(f"seed {seed}: a process stopped with {start['cls']}: {start['message']}")
        elif start["cls"] == "InvalidArgument" and start["seconds"] > BAD_START_LIMIT:
            violations.append(f"seed {seed}: a bad start took {start['seconds']:.1f} s to be refused")
    # A rank's log is its process's that got past the start: one process per rank, two for
    # the duplicated one (of which at least one stops at the start).
    processes = collections.Counter([*range(schedule["ranks"]), duplicated])
    processes.subtract(int(start["rank"]) for start in starts)
    stopped = {rank for rank, running in processes.items() if running <= 0}
    told = len(starts)
    for rank in set(range(schedule["ranks"])) - stopped:
        log = outdir / f"rank{rank}.jsonl"
        entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
        errors = sorted((e for e in entries if e["outcome"] == "error"), key=lambda e: e["i"])
        if errors and said in errors[0]["message"]:
            told += 1
        else:
            first = errors[0]["message"] if errors else "none: it ran on"
            violations.append(f"seed {seed}: rank {rank} did not stop for the second rank {duplicated}: {first}")
    if told != schedule["ranks"] + 1:
        violations.append(
            f"seed {seed}: {told} of the job's {schedule['ranks'] + 1} processes said that rank {duplicated} was "
            "started twice"
        )
    return violations, stopped


def check_logs(schedule: dict[str, Any], outdir: Path) -> list[str]:
    seed, fault, timeout = schedule["seed"], schedule["fault"], schedule["timeout"]
    harmless = fault["kind"] in ("none", "stop-short", "delay", "stranger")
    victim = None if harmless or fault["kind"] == "duplicate" else fault["rank"]
    violations = []
    ranks: list[int] = list(range(schedule["ranks"]))
    logs: dict[int, list[dict[str, Any]]] = {}
    if fault["kind"] == "duplicate":  # every process stops, saying why (checked here; the calls below)
        found, stopped = check_duplicate(schedule, outdir)
        violations += found
        ranks = [r for r in ranks if r not in stopped]
    elif any(outdir.glob("start-*.json")):
        starts = [json.loads(p.read_text()) for p in outdir.glob("start-*.json")]
        violations += [
            f"seed {seed}: rank {s['rank']} stopped before its calls: {s['cls']}: {s['message']}" for s in starts
        ]
    for rank in ranks:
        log = outdir / f"rank{rank}.jsonl"
        entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
        entries.sort(key=lambda entry: entry["i"])  # in call order (async calls are logged as they end)
        logs[rank] = entries
        # Every call must be accounted for, but the killed rank's, and the others' when the
        # launcher stops the job after a rank died (as it should).
        ended = fault["kind"] in ("kill", "raise")
        if not (ended and (rank == victim or schedule["launch"] == "run")):
            groups = schedule["groups"]
            mine = {i for i, c in enumerate(schedule["calls"]) if rank in groups.get(c["group"], [rank])}
            missing = sorted(mine - {entry["i"] for entry in entries})
            if missing:
                violations.append(f"seed {seed}: rank {rank} never finished calls {missing} (it crashed or hung)")
        first_error = None
        for entry in entries:
            where = f"seed {seed}: rank {rank}, call {entry['i']} ({entry['op']} on {entry['group']})"
            if entry["outcome"] == "wrong":
                violations.append(f"{where}: WRONG RESULT {entry.get('got')} instead of {entry.get('want')}")
            elif entry["outcome"] == "error":
                first_error = first_error or entry
                if harmless:
                    violations.append(
                        f"{where}: raised {entry['cls']} with no fault past the deadline: {entry['message']}"
                    )
                limit = 4 * timeout + SLACK  # itself and up to 3 calls in flight before it
                if entry["seconds"] > limit:
                    violations.append(f"{where}: raised after {entry['seconds']} s (limit {limit:g} s)")
        if victim is not None and rank != victim and first_error is not None:
            blamed = first_error.get("blamed", [])
            if victim not in blamed and f"rank {victim}" not in first_error["message"]:
                violations.append(
                    f"seed {seed}: rank {rank}'s first error does not name rank {victim} ({fault['kind']}): "
                    f"{first_error['message']}"
                )
    return violations + check_failures_reach_every_rank(schedule, logs)


def check_failures_reach_every_rank(schedule: dict[str, Any], logs: dict[int, list[dict[str, Any]]]) -> list[str]:
    """The semantics ferrodist states (docs/failures.md): no rank returns a wrong value (checked
    above); a failure reaches every member as an exception no later than its next call on the
    group; and a group that failed on a rank stays failed there."""
    seed, violations = schedule["seed"], []
    names = {call["group"] for call in schedule["calls"]}
    for name in sorted(names):
        members = schedule["groups"].get(name, list(range(schedule["ranks"])))
        on_group = {r: [e for e in logs.get(r, []) if e["group"] == name] for r in members}
        failed = [e["i"] for entries in on_group.values() for e in entries if e["outcome"] == "error"]
        if not failed:
            continue
        first = min(failed)
        for rank, entries in on_group.items():
            later = [e for e in entries if e["i"] > first]
            at = next((e for e in entries if e["i"] == first), None)
            if at is None:
                continue  # this rank never finished the call (it is the one that died, or it was stopped)
            if at["outcome"] == "ok" and later and later[0]["outcome"] != "error":
                violations.append(
                    f"seed {seed}: group {name} failed at call {first} on another rank, but rank {rank} returned "
                    f"that call and then call {later[0]['i']} too (it must raise no later than its next call)"
                )
            seen_error = at["outcome"] == "error"
            for entry in later:
                if seen_error and entry["outcome"] != "error":
                    violations.append(
                        f"seed {seed}: rank {rank} returned call {entry['i']} on group {name} after the group "
                        "failed there (it must stay aborted)"
                    )
                    break
                seen_error = seen_error or entry["outcome"] == "error"
    return violations


def run_seeds(
    title: str,
    seeds: range,
    make: Callable[[int], dict[str, Any]],
    run: Callable[[dict[str, Any], Path], list[str]],
    kind: Callable[[dict[str, Any]], str],
    outdir: Path,
) -> list[str]:
    """Run the schedule of each seed beside ``FERRODIST_CHAOS_HOG`` busy processes, printing
    a line for each and a summary (its load, and the schedules by ``kind``); the violations."""
    started = time.monotonic()
    violations: list[str] = []
    kinds: dict[str, int] = {}
    loads: list[float] = []
    with hog_from_environment() as hog:
        for seed in seeds:
            schedule = make(seed)
            key = kind(schedule)
            kinds[key] = kinds.get(key, 0) + 1
            found = run(schedule, outdir / f"s{seed}")
            loads.append(schedule["load"])
            said = f"load {schedule['load']:.1f} ({schedule['runnable']} runnable)"
            print(f"seed {seed} {key}: {said}, {len(found)} violations", flush=True)
            violations += found
    took = time.monotonic() - started
    print(
        f"\n{title}: {len(seeds)} schedules (seeds {seeds.start}..{seeds.stop - 1}) in {took:.0f} s "
        f"beside {hog.count} busy processes, load {min(loads):.1f}..{max(loads):.1f}, {len(violations)} violations; "
        f"by fault/backend/launch: {dict(sorted(kinds.items()))}"
    )
    return violations
