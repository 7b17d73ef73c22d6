"""The GPU check's summary: one Markdown table of every step tools/gpu_check.sh ran.

    python tools/gpu_summary.py RESULTS_DIR

Reads what the steps left in RESULTS_DIR (tools/gpu_check.sh's ``$RESULTS``):

- ``steps.tsv``: one line per step, ``id<TAB>exit status<TAB>command`` (the status is
  ``skip: reason`` for a step that was not run);
- ``<id>.jsonl`` for a pytest step: one JSON object per event, written as it happens by
  this module loaded as a pytest plugin (``-p gpu_summary`` with ``FERRODIST_GPU_REPORT``
  naming the file), so a step that crashes still has its counts up to the crash and the
  name of the test that was running;
- ``bench-all-reduce.json``, ``bench-kernels.json``, ``bench-ddp.json``: the rows that
  bench/gpu/all_reduce.py, kernels.py and ddp.py write with ``--json``;
- ``machine.json``: the versions and the GPU (optional).

Prints the table, the failed tests, and how to rerun each step; exits 1 when a step failed,
crashed, timed out or wrote no results, else 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The table's columns (a test step fills "case" with its counts; a benchmark, one row per case).
COLUMNS = ("step", "status", "case", "ferrodist", "reference", "ferrodist / reference", "Gloo", "Gloo / ferrodist")
#: The exit status ``timeout`` gives a command that ran too long.
TIMED_OUT = 124
#: How many failed tests of one step are named below the table.
NAMED = 20

# ---------------------------------------------------------------------------------------
# The pytest plugin: events appended to $FERRODIST_GPU_REPORT as they happen
# ---------------------------------------------------------------------------------------


def _record(event: dict[str, Any]) -> None:
    path = os.environ.get("FERRODIST_GPU_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:  # closed (flushed to the OS) at once: survives a crash
            out.write(json.dumps(event) + "\n")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _record({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    _record(
        {
            "event": "report",
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "xfail": bool(getattr(report, "wasxfail", "")),
        }
    )


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _record({"event": "collect", "nodeid": report.nodeid, "outcome": "failed"})


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    _record({"event": "finish", "exitstatus": int(exitstatus)})


# ---------------------------------------------------------------------------------------
# Reading the results
# ---------------------------------------------------------------------------------------


@dataclass
class Counts:
    """A pytest step's outcomes, read from its events."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    finished: bool = False
    running: str | None = None  # the test that started and never finished (a crash)
    failures: list[str] = field(default_factory=list)

    def text(self) -> str:
        return f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped, {self.errors} errors"


def count(path: Path) -> Counts | None:
    """The counts in a pytest step's event file (None when there is none)."""
    if not path.exists():
        return None
    counts = Counts()
    open_tests: dict[str, None] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        kind, nodeid = event.get("event"), event.get("nodeid", "")
        if kind == "start":
            open_tests[nodeid] = None
        elif kind == "collect":
            counts.errors += 1
            counts.failures.append(f"{nodeid} (collection error)")
        elif kind == "finish":
            counts.finished = True
        elif kind == "report":
            when, outcome = event.get("when"), event.get("outcome")
            if when == "teardown":
                open_tests.pop(nodeid, None)
            if outcome == "skipped":
                counts.skipped += 1
            elif outcome == "failed" and when == "call":
                counts.failed += 1
                counts.failures.append(nodeid)
            elif outcome == "failed":
                counts.errors += 1
                counts.failures.append(f"{nodeid} (error in {when})")
            elif outcome == "passed" and when == "call":
                counts.passed += 1
    if not counts.finished and open_tests:
        counts.running = list(open_tests)[-1]
    return counts


@dataclass(frozen=True)
class Step:
    id: str
    status: str  # the exit status, or "skip: reason"
    command: str


def steps(results: Path) -> list[Step]:
    found = []
    path = results / "steps.tsv"
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            parts = line.split("\t", 2)
            if len(parts) == 3:
                found.append(Step(*parts))
    return found


#: What pytest's exit statuses mean (beyond 0).
PYTEST_EXITS = {
    1: "tests failed",
    2: "interrupted: a collection error, or stopped",
    3: "pytest's internal error",
    4: "pytest usage error",
    5: "no tests collected",
}


def exit_text(code: int, meanings: dict[int, str]) -> str:
    """What an exit status says: the signal that ended the command, a timeout, or the code
    (with its meaning from ``meanings``)."""
    number = code - 128 if code > 128 else -code if code < 0 else 0
    if number:
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown signal"
        return f"CRASHED (signal {number}, {name})"
    if code == TIMED_OUT:
        return "TIMED OUT (STEP_TIMEOUT)"
    return f"FAILED (exit {code}: {meanings[code]})" if code in meanings else f"FAILED (exit {code})"


# ---------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------

Row = tuple[str, str, str, str, str, str, str, str]


def show_time(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def ratio(value: float | None, suffix: str = "") -> str:
    return "" if value is None else f"{value:.2f}{suffix}"


def all_reduce_rows(data: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """(case, ferrodist, reference, ratio, Gloo, Gloo / ferrodist) per size."""
    for row in data.get("rows", []):
        yield (
            f"{row['size']} {data.get('dtype', '')}".strip(),
            show_time(row["ferrodist_s"]),
            f"floor {show_time(row['floor_s'])}",
            ratio(row["ferrodist_per_floor"]),
            show_time(row.get("gloo_s")),
            ratio(row.get("gloo_per_ferrodist"), "x"),
        )


def kernel_rows(data: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """(case, ferrodist, reference, ratio) per dtype: bench/gpu/kernels.py's rows (dtype,
    ours_gbps, torch_gbps, ratio, same_bits, error; the figures are null for a dtype that failed)."""
    for row in data.get("rows", []):
        if row.get("ratio") is None:
            yield (row["dtype"], f"failed: {row.get('error')}")
            continue
        bits = "" if row.get("same_bits") else f" (NOT the same bits as torch add_: {row.get('error')})"
        yield (
            row["dtype"] + bits,
            f"{row['ours_gbps']:.0f} GB/s",
            f"torch add_ {row['torch_gbps']:.0f} GB/s",
            ratio(row["ratio"]),
        )


def ddp_rows(data: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """(case, ferrodist, reference, ratio, Gloo, Gloo / ferrodist): one row per ferrodist
    configuration against torch DDP over Gloo, then the parameter check."""
    rows = data.get("rows", [])
    gloo = next((row for row in rows if row["key"] == "torch_ddp_gloo"), None)
    for row in rows:
        if row is gloo:
            continue
        yield (
            row["configuration"],
            show_time(row["median_s"]),
            "",
            "",
            show_time(gloo["median_s"]) if gloo else "",
            ratio(row.get("gloo_per_this"), "x"),
        )
    check = data.get("check")
    if check:
        worst = max(check["max_abs_difference"].values(), default=0.0)
        found = "bit-equal" if worst == 0 else f"largest difference {worst:.3g}"
        verdict = "same model" if check["passed"] else "NOT the same model"
        yield ("parameters vs torch DDP over Gloo", f"{found} (allowed {check['tolerance']:g}): {verdict}")


#: Benchmark steps: their JSON file's rows.
BENCHES = {"bench-all-reduce": all_reduce_rows, "bench-kernels": kernel_rows, "bench-ddp": ddp_rows}


def summarise(results: Path) -> tuple[list[Row], list[str], bool]:
    """The table's rows, the lines below it, and whether every step that ran succeeded."""
    table: list[Row] = []
    notes: list[str] = []
    ok = True
    for step in steps(results):
        if step.status.startswith("skip"):
            table.append(row_of(step.id, step.status.replace("skip:", "skipped:", 1), ()))
            continue
        code = int(step.status)
        status = "ok" if code == 0 else exit_text(code, PYTEST_EXITS if step.id not in BENCHES else {})
        cases: list[tuple[str, ...]] = []
        if step.id in BENCHES:
            path = results / f"{step.id}.json"
            if path.exists():
                try:
                    cases = list(BENCHES[step.id](json.loads(path.read_text(encoding="utf-8"))))
                except (ValueError, KeyError, TypeError) as exc:
                    status += f"; {path.name} unreadable ({type(exc).__name__}: {exc})"
                    code = code or 1
            else:
                status += f"; it wrote no {path.name}"
                code = code or 1
        else:
            counts = count(results / f"{step.id}.jsonl")
            if counts is None:
                cases = [("no test results (no event file)",)]
            else:
                if counts.running is not None:
                    status += f" while running {counts.running}"
                    code = code or 1
                elif not counts.finished and code == 0:
                    status += "; pytest did not finish"
                    code = 1
                cases = [(counts.text(),)]
                if counts.failures:
                    notes.append(f"{step.id}: {len(counts.failures)} failed or in error:")
                    notes += [f"  {name}" for name in counts.failures[:NAMED]]
                    if len(counts.failures) > NAMED:
                        notes.append(f"  ... and {len(counts.failures) - NAMED} more (see the step's output)")
        ok = ok and code == 0
        for i, case in enumerate(cases or [("no rows",)]):
            table.append(row_of(step.id if i == 0 else "", status if i == 0 else "", case))
    return table, notes, ok


def row_of(step: str, status: str, case: tuple[str, ...]) -> Row:
    """A table row: the step, its status and a case's cells, the rest left empty."""
    cells = [step, status, *case] + [""] * (len(COLUMNS) - 2 - len(case))
    return (cells[0], cells[1], cells[2], cells[3], cells[4], cells[5], cells[6], cells[7])


def machine(results: Path) -> str:
    path = results / "machine.json"
    if not path.exists():
        return ""
    facts = json.loads(path.read_text(encoding="utf-8"))
    return ", ".join(f"{name} {value}" for name, value in facts.items())


def markdown(rows: list[Row]) -> str:
    clean = [[cell.replace("|", "\\|") for cell in row] for row in rows]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in clean]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    results = Path(argv[0])
    rows, notes, ok = summarise(results)
    facts = machine(results)
    print("== summary" + (f" ({facts})" if facts else ""))
    print(markdown(rows))
    for line in notes:
        print(line)
    env = results / "env.sh"
    commands = [step for step in steps(results) if not step.status.startswith("skip")]
    if commands:
        print(f"rerun one step: . {env} (the environment the steps ran in), then its command:")
        for step in commands:
            print(f"  {step.id}: {step.command}")
    print("verdict: " + ("every step passed" if ok else "FAILED: see the status column"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
