"""One rank of a chaos schedule (see tests/integration/chaos.py, which starts it).

    chaos.py SPEC_JSON OUTDIR

The spec says the backend, the per-call timeout, the calls (operation, group, dtype,
size, root, async) and the fault (which rank, at which call, what). Every rank runs the
same calls; values are a function of (seed, call, rank), so each rank knows every
result. For each call it appends one JSON line to OUTDIR/rank{R}.jsonl: ``ok`` (the
result was checked against numpy), ``wrong`` (it was not what numpy says), or ``error``
(the class, message and seconds from issue to raise). A process that fails before its
calls (its start, making the groups, the warm-up) writes OUTDIR/start-{pid}.json.

With the ``duplicate`` fault (a second process started with one of the ranks), a process
whose init succeeded makes no call before every process has ended its init.

The ``stranger`` fault is a thread of the faulty rank that plays a process outside the
job during the start: as soon as the ranks publish their ports in the store, it opens
connections to each of them (and to the store) that stay silent, or send bytes that are
not ferrodist, and holds them open until the process exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import FerrodistError
from ferrodist.transport import StoreClient

#: What the stranger sends on its talkative connections (an HTTP request: not ferrodist).
GARBAGE = b"GET / HTTP/1.0\r\n\r\n"


def values(seed: int, i: int, rank: int, n: int, dtype: str) -> np.ndarray:
    base = (np.arange(n) * 7 + seed * 13 + i * 3 + rank * 5) % 11
    return base.astype(dtype)


class Rank:
    def __init__(self, spec: dict[str, Any], outdir: Path) -> None:
        self.spec = spec
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.log = open(outdir / f"rank{self.rank}.jsonl", "w", buffering=1)
        self.lock = threading.Lock()
        self.groups: dict[str, Any] = {"world": None}
        for name, members in spec["groups"].items():
            self.groups[name] = dist.new_group(members)  # every rank makes every group, in order

    def warm_up(self) -> None:
        """Every kind of call the schedule may make, once per dtype and size, under a long
        timeout, so that the schedule's calls run compiled code (a cold schedule skips it:
        its calls start on the interpreted paths while the kernels compile)."""
        spec = dict(self.spec, timeout=300.0, fault={"kind": "none"})
        warm = Rank.__new__(Rank)
        warm.__dict__.update(self.__dict__, spec=spec)
        for name in ["world", *spec["groups"]]:
            for op in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"):
                for dtype in ("float32", "float64", "int32"):
                    for n in (1, 300_000):
                        call = {"op": op, "group": name, "dtype": dtype, "n": n, "root": 0, "async": False}
                        if warm.issue(-1, call) is None:
                            break
            for op in ("gather", "scatter", "all_to_all", "barrier"):
                warm.issue(-1, {"op": op, "group": name, "dtype": "float32", "n": 1, "root": 0, "async": False})

    def record(self, i: int, call: dict[str, Any], outcome: str, started: float, **extra: Any) -> None:
        entry = {"i": i, "op": call["op"], "group": call["group"], "outcome": outcome}
        entry["seconds"] = round(time.monotonic() - started, 3)
        entry.update(extra)
        with self.lock:
            self.log.write(json.dumps(entry) + "\n")

    def fault(self, i: int) -> None:
        fault = self.spec["fault"]
        if fault["kind"] == "none" or fault["rank"] != self.rank or fault["at"] != i:
            return
        kind, pid = fault["kind"], os.getpid()
        if kind == "kill":
            threading.Timer(fault["after"], os.kill, (pid, signal.SIGKILL)).start()
        elif kind in ("stop", "stop-short"):
            # Someone else must wake us: a shell that sleeps, then sends SIGCONT.
            subprocess.Popen(["sh", "-c", f"sleep {fault['seconds']}; kill -CONT {pid}"], start_new_session=True)
            threading.Timer(fault["after"], os.kill, (pid, signal.SIGSTOP)).start()
        elif kind == "delay":
            time.sleep(fault["seconds"])
        elif kind == "raise":
            raise RuntimeError(f"rank {self.rank}: injected failure before call {i}")

    def issue(self, i: int, call: dict[str, Any]) -> tuple[Any, Any] | None:
        """Start call ``i``; returns (work or None, (result, what it must be) or None), or
        None when this rank is not in the call's group."""
        group = self.groups[call["group"]]
        members = self.spec["groups"].get(call["group"], list(range(self.size)))
        if self.rank not in members:
            return None
        me, p = members.index(self.rank), len(members)
        n, dtype, root, op = call["n"], call["dtype"], call["root"] % p, call["op"]
        seed, timeout, async_op = self.spec["seed"], self.spec["timeout"], call["async"]
        mine = values(seed, i, self.rank, n, dtype)
        theirs = [values(seed, i, r, n, dtype) for r in members]
        kw = {"group": group, "async_op": async_op, "timeout": timeout}
        if op == "all_reduce":
            x = mine.copy()
            work = dist.all_reduce(x, **kw)
            return work, (x, np.sum(theirs, axis=0, dtype=dtype))
        if op == "broadcast":
            x = mine.copy()
            work = dist.broadcast(x, src=members[root], **kw)
            return work, (x, theirs[root])
        if op == "reduce":
            x = mine.copy()
            work = dist.reduce(x, dst=members[root], **kw)
            return work, (x, np.sum(theirs, axis=0, dtype=dtype) if me == root else mine)
        if op == "all_gather":
            out = np.empty(n * p, dtype)
            work = dist.all_gather(out, mine.copy(), **kw)
            return work, (out, np.concatenate(theirs))
        if op == "reduce_scatter":
            out = np.empty(n, dtype)
            blocks = np.concatenate([values(seed, i, self.rank + 100 * q, n, dtype) for q in range(p)])
            work = dist.reduce_scatter(out, blocks, **kw)
            want = np.sum([values(seed, i, r + 100 * me, n, dtype) for r in members], axis=0, dtype=dtype)
            return work, (out, want)
        if op == "gather":
            out = np.empty(n * p, dtype) if me == root else None
            work = dist.gather(mine.copy(), out, dst=members[root], **kw)
            return work, (out, np.concatenate(theirs)) if me == root else None
        if op == "scatter":
            x = np.empty(n, dtype)
            parts = np.concatenate([values(seed, i, members[root] + 100 * q, n, dtype) for q in range(p)])
            work = dist.scatter(x, parts if me == root else None, src=members[root], **kw)
            return work, (x, values(seed, i, members[root] + 100 * me, n, dtype))
        if op == "all_to_all":
            out = np.empty(n * p, dtype)
            ins = np.concatenate([values(seed, i, self.rank + 100 * q, n, dtype) for q in range(p)])
            work = dist.all_to_all(out, ins, **kw)
            return work, (out, np.concatenate([values(seed, i, r + 100 * me, n, dtype) for r in members]))
        work = dist.barrier(**kw)
        return work, None

    def run(self) -> None:
        """All calls in this thread, or (``threads``) each group's calls in a thread of its own."""
        calls = list(enumerate(self.spec["calls"]))
        if not self.spec.get("threads"):
            self.run_calls(calls)
            return
        names = sorted({call["group"] for _, call in calls})
        threads = [
            threading.Thread(target=self.run_calls, args=([(i, c) for i, c in calls if c["group"] == name],))
            for name in names
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def run_calls(self, calls: list[tuple[int, dict[str, Any]]]) -> None:
        pending: list[tuple[int, dict[str, Any], Any, Any, float]] = []
        for i, call in calls:
            self.fault(i)
            started = time.monotonic()
            try:
                issued = self.issue(i, call)
            except FerrodistError as exc:
                self.failed(i, call, started, exc)
                continue
            if issued is None:
                continue
            work, check = issued
            if work is not None:
                pending.append((i, call, work, check, started))
            else:
                self.verify(i, call, check, started)
            if call.get("flush") or len(pending) >= 3:
                self.drain(pending)
        self.drain(pending)

    def drain(self, pending: list[tuple[int, dict[str, Any], Any, Any, float]]) -> None:
        for i, call, work, check, started in pending:
            try:
                work.wait()
            except FerrodistError as exc:
                self.failed(i, call, started, exc)
                continue
            self.verify(i, call, check, started)
        pending.clear()

    def failed(self, i: int, call: dict[str, Any], started: float, exc: FerrodistError) -> None:
        blamed = list(getattr(exc, "waiting_for", ()))
        if getattr(exc, "peer", None) is not None:
            blamed.append(exc.peer)  # type: ignore[attr-defined]
        self.record(i, call, "error", started, cls=type(exc).__name__, message=str(exc)[:2000], blamed=blamed)

    def verify(self, i: int, call: dict[str, Any], check: Any, started: float) -> None:
        if check is not None:
            got, want = check
            if not np.array_equal(got, want):
                self.record(i, call, "wrong", started, got=str(got[:6]), want=str(want[:6]))
                return
        self.record(i, call, "ok", started)


def stranger(spec: dict[str, Any], kept: list[socket.socket]) -> None:
    """Connections to every port of the starting job that never speak ferrodist (see the
    module docstring). It learns the ports from the store, as any process of an open job
    could, or one that scans the host."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        store = StoreClient(host, port, timeout=spec["timeout"] + 5)
    except (FerrodistError, OSError):
        return
    targets = [(host, port)]
    try:
        for peer in range(int(os.environ["WORLD_SIZE"])):
            address = store.get(f"ferrodist/addr/{peer}", timeout=spec["timeout"] + 5).decode()
            peer_host, _, peer_port = address.rpartition(":")
            targets.append((peer_host, int(peer_port)))
    except FerrodistError:
        pass
    finally:
        store.close()
    for target in targets:
        for talk in (b"", b"", b"", GARBAGE):
            try:
                sock = socket.create_connection(target, timeout=2)
                if talk:
                    sock.sendall(talk)
                kept.append(sock)
            except OSError:
                pass


def main() -> None:
    spec = json.loads(sys.argv[1])
    outdir = Path(sys.argv[2])
    started = time.monotonic()
    fault = spec["fault"]
    kept: list[socket.socket] = []
    if fault["kind"] == "stranger" and fault["rank"] == int(os.environ["RANK"]):
        threading.Thread(target=stranger, args=(spec, kept), daemon=True).start()
    try:
        try:
            dist.init_process_group(spec["backend"], timeout=spec["timeout"])
        finally:
            if fault["kind"] == "duplicate":
                (outdir / f"init-ended-{os.getpid()}").write_text("")
        (outdir / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
        if fault["kind"] == "duplicate":
            # No call before every process, the second one with this rank included, has
            # ended its init: the job is still running when the second one registers (a
            # short job would otherwise be over, and its store gone, by then).
            give_up = time.monotonic() + 15.0
            while len(list(outdir.glob("init-ended-*"))) < spec["ranks"] + 1 and time.monotonic() < give_up:
                time.sleep(0.01)
        rank = Rank(spec, outdir)
        if not spec.get("cold"):  # on a cold cache the calls meet the compiler under their own deadlines
            rank.warm_up()
    except FerrodistError as exc:  # a bad start (or a job stopped just after it): every process must say why
        record = {
            "cls": type(exc).__name__,
            "message": str(exc)[:2000],
            "seconds": time.monotonic() - started,
            "rank": int(os.environ["RANK"]),
            "traceback": traceback.format_exc()[-4000:],
        }
        (outdir / f"start-{os.getpid()}.json").write_text(json.dumps(record))
        sys.exit(1)
    rank.run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
