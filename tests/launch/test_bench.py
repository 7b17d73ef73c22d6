"""`ferrodist bench`: formulas, report, and a small real sweep with the comparison libraries."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")
from ferrodist.launch._bench.report import table
from ferrodist.launch._bench.sweep import available, busbw


def test_busbw_follows_nccl_tests():
    # 1 GB in 1 s on 4 ranks: algbw 1 GB/s.
    assert busbw("all_reduce", 10**9, 1.0, 4) == pytest.approx(1.5)
    assert busbw("broadcast", 10**9, 1.0, 4) == pytest.approx(1.0)
    assert busbw("all_gather", 10**9, 1.0, 4) == pytest.approx(0.75)
    assert busbw("reduce_scatter", 10**9, 1.0, 4) == pytest.approx(0.75)


def test_table_shows_times_bandwidths_and_ratios_to_the_baseline():
    records = [
        {
            "library": "ferrodist:shm",
            "op": "all_reduce",
            "bytes": 4096,
            "seconds": 20e-6,
            "ranks": 2,
            "dtype": "float32",
        },
        {"library": "gloo", "op": "all_reduce", "bytes": 4096, "seconds": 600e-6, "ranks": 2, "dtype": "float32"},
    ]
    text = table(records, baseline="ferrodist:shm")
    assert "### all_reduce (2 ranks, float32): time, and x ferrodist:shm's" in text
    assert "| 4 KiB | 20.0 us | 600.0 us (30.00x) |" in text
    assert "| 4 KiB | 0.20 | 0.01 |" in text  # busbw
    assert max(len(line) for line in text.splitlines()) < 100


def test_a_small_sweep_against_the_references(tmp_path):
    out, picture = tmp_path / "bench.json", tmp_path / "bench.png"
    command = [
        sys.executable,
        "-m",
        "ferrodist.launch",
        "bench",
        "-n",
        "2",
        "--backends",
        "shm,tcp",
        "--compare",
        "--ops",
        "all_reduce,broadcast",
        "--min-bytes",
        "4096",
        "--max-bytes",
        "16384",
        "--rounds",
        "1",
        "--json",
        str(out),
        "--plot",
        str(picture),
        "--no-progress",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    libraries = {r["library"] for r in data["records"]}
    expected = {"ferrodist:shm", "ferrodist:tcp", "floor"}
    expected |= {lib for lib in ("gloo", "mpi4py") if available(lib) is None}
    assert libraries == expected
    assert {r["op"] for r in data["records"]} == {"all_reduce", "broadcast"}
    assert all(r["seconds"] > 0 and r["busbw_gbps"] > 0 for r in data["records"])
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "### all_reduce (2 ranks, float32)" in done.stdout
    header = next(line for line in done.stdout.splitlines() if line.startswith("| size | ferrodist:shm"))
    assert set(header.strip("| ").split(" | ")) == {"size", *expected}
    assert "(ferrodist:shm at " in done.stdout  # the floor's cell: how far shm is from memory speed
    assert max(len(line) for line in done.stdout.splitlines()) < 160


def test_the_floor_column_divides_the_baseline_by_the_floor():
    records = [
        {"library": name, "op": "all_reduce", "bytes": 1 << 26, "seconds": seconds, "ranks": 2, "dtype": "float32"}
        for name, seconds in (("ferrodist:shm", 0.026), ("mpi4py", 0.052), ("floor", 0.020))
    ]
    text = table(records, baseline="ferrodist:shm")
    assert "| 64 MiB | 26.00 ms | 52.00 ms (2.00x) | 20.00 ms (ferrodist:shm at 1.30x) |" in text
    assert "| 64 MiB | 2.58 | 1.29 |" in text  # busbw: the floor has none
    assert "of ferrodist:shm" not in table(records, baseline="floor")  # the floor is never a baseline
    assert "x ferrodist:shm's" in table(records, baseline="floor")


def test_passes_alternate_the_library_order_and_keep_each_fastest_median(monkeypatch):
    from ferrodist.launch._bench import sweep

    calls: list[str] = []
    slow = {"a": [3.0, 1.0], "b": [2.0, 5.0]}  # seconds per pass, per library

    def fake_run(library, spec, progress):
        calls.append(library)
        seconds = slow[library][sum(1 for c in calls if c == library) - 1]
        return [
            {"library": library, "op": op, "bytes": 4096, "seconds": seconds, "ranks": 2, "dtype": "float32"}
            for op in spec.ops
        ]

    monkeypatch.setattr(sweep, "_run_library", fake_run)
    monkeypatch.setattr(sweep, "available", lambda library, dtype="float32": None)
    spec = sweep.BenchSpec(libraries=("a", "b"), ops=("broadcast", "all_reduce"), sizes=(4096,), passes=2)
    records = sweep.sweep(spec, show_progress=False)
    assert calls == ["a", "b", "b", "a"]
    assert [(r["library"], r["op"], r["seconds"]) for r in records] == [
        ("a", "broadcast", 1.0),
        ("a", "all_reduce", 1.0),
        ("b", "broadcast", 2.0),
        ("b", "all_reduce", 2.0),
    ]
    assert all(r["passes"] == 2 for r in records)


def test_a_sweep_writes_no_file_unless_asked(tmp_path):
    """Without --json and --plot the table is the whole result: nothing lands in the
    current directory."""
    command = [sys.executable, "-m", "ferrodist.launch", "bench", "-n", "2", "--backends", "shm", "--no-floor"]
    command += ["--ops", "all_reduce", "--min-bytes", "4096", "--max-bytes", "4096", "--rounds", "1", "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "### all_reduce (2 ranks, float32)" in done.stdout and "| 4 KiB |" in done.stdout
    assert list(tmp_path.iterdir()) == []
    assert "wrote" not in done.stdout


FAKE = [
    {"library": name, "op": op, "bytes": 4096, "seconds": 1e-5, "ranks": 2, "dtype": "float32"}
    for name in ("ferrodist:shm", "floor")
    for op in ("all_reduce", "broadcast")
]


def test_without_matplotlib_plot_names_the_extra_and_the_table_is_still_printed(monkeypatch, capsys, tmp_path):
    from ferrodist.launch import _cli, main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setattr(_cli, "sweep", lambda spec, show_progress=True: list(FAKE))
    picture, out = tmp_path / "bench.png", tmp_path / "bench.json"
    code = main(["bench", "--plot", str(picture), "--json", str(out), "--no-progress"])
    said = capsys.readouterr()
    assert code == 1
    assert "pip install matplotlib" in said.err and f"--plot {picture}" in said.err
    assert "### all_reduce (2 ranks, float32)" in said.out  # the table all the same
    assert not picture.exists() and json.loads(out.read_text())["records"]  # and the JSON that was asked for


def test_a_plot_path_in_no_directory_is_refused_before_the_sweep(monkeypatch, capsys, tmp_path):
    from ferrodist.launch import _cli, main

    monkeypatch.setattr(_cli, "sweep", lambda spec, show_progress=True: pytest.fail("the sweep ran"))
    assert main(["bench", "--json", str(tmp_path / "no" / "such.json")]) == 2
    assert f"there is no directory {tmp_path / 'no'}" in capsys.readouterr().err


def test_the_plot_leaves_out_the_memory_floor(monkeypatch, capsys, tmp_path):
    """The floor is not a collective and has no busbw: it is in the table, not in the plot."""
    from ferrodist.launch import _cli, main

    drawn: list = []
    monkeypatch.setattr(_cli, "sweep", lambda spec, show_progress=True: list(FAKE))
    monkeypatch.setattr(_cli, "plot", lambda path, records: drawn.append((path, records)))
    assert main(["bench", "--plot", str(tmp_path / "bench.png"), "--no-progress"]) == 0
    assert "| size | ferrodist:shm | floor |" in capsys.readouterr().out
    [(path, records)] = drawn
    assert path == str(tmp_path / "bench.png")
    assert {r["library"] for r in records} == {"ferrodist:shm"}


class _ColdLibrary:
    """A stand-in library whose first calls are slow (what loading kernels, first connections
    and first touches of buffers cost a real one), then fast."""

    rank, size = 0, 1

    def __init__(self) -> None:
        self.calls = 0

    def barrier(self) -> None:
        pass

    def op(self, name, count, dtype):
        import time

        def call() -> None:
            self.calls += 1
            if self.calls <= 12:
                time.sleep(0.005)

        return call

    def close(self) -> None:
        pass

    def settle(self) -> None:
        pass


class _CompilingLibrary(_ColdLibrary):
    """A stand-in for ferrodist while a kernel compiles in the background: calls are slow
    (its interpreted path) until ``settle`` has waited for the compile."""

    def __init__(self) -> None:
        super().__init__()
        self.settled = False

    def op(self, name, count, dtype):
        import time

        self.settled = False  # a new size: a kernel of its own may start compiling

        def call() -> None:
            if not self.settled:
                time.sleep(0.005)

        return call

    def settle(self) -> None:
        self.settled = True


def test_the_first_size_is_timed_warm(monkeypatch, tmp_path):
    """Every collective is warmed before the first timed size: its row is not slower than the
    next one for what a library does once."""
    from ferrodist.launch._bench import worker

    monkeypatch.setattr(worker, "_library", lambda name: _ColdLibrary())
    out = tmp_path / "results.jsonl"
    spec = {"ops": ["all_reduce", "broadcast"], "sizes": [4096, 16384], "dtype": "float32", "rounds": 3}
    spec.update(target=0.01, warmup=0.05)
    monkeypatch.setattr(sys, "argv", ["worker", "cold", str(out), json.dumps(spec)])
    worker.main()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("all_reduce", 4096),
        ("all_reduce", 16384),
        ("broadcast", 4096),
        ("broadcast", 16384),
    ]
    assert all(r["seconds"] < 1e-3 for r in rows), rows  # none of the 5 ms first calls was timed


def test_the_plot_is_log_log_with_a_line_per_library_and_no_floor(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from ferrodist.launch._bench.report import plot
    from ferrodist.launch._bench.sweep import FLOOR

    drawn: list = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: drawn.append(self))
    with_floor = [*FAKE, {**FAKE[0], "library": FLOOR}]
    plot(str(tmp_path / "bench.png"), with_floor)
    [fig] = drawn
    for ax in fig.axes:
        assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
        assert FLOOR not in [line.get_label() for line in ax.get_lines()]


def test_every_size_is_timed_after_the_background_compiles(monkeypatch, tmp_path):
    """A size's first call may set a kernel compiling: the worker waits for it (``settle``)
    before it times that size, so no interpreted call is timed."""
    from ferrodist.launch._bench import worker

    monkeypatch.setattr(worker, "_library", lambda name: _CompilingLibrary())
    out = tmp_path / "results.jsonl"
    spec = {"ops": ["all_reduce"], "sizes": [4096, 16384, 65536], "dtype": "float32", "rounds": 3}
    spec.update(target=0.01, warmup=0.02)
    monkeypatch.setattr(sys, "argv", ["worker", "compiling", str(out), json.dumps(spec)])
    worker.main()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3
    assert all(r["seconds"] < 1e-3 for r in rows), rows


def test_trace_png_without_matplotlib_merges_and_exits_1_as_bench_plot_does(monkeypatch, capsys, tmp_path):
    """Both commands do their work and say how to get the picture; neither is a usage error (2)."""
    from ferrodist.launch import main

    (tmp_path / "rank-0.json").write_text(
        '[{"name":"all_reduce","cat":"collective","ph":"X","ts":10,"dur":5,"pid":0,"tid":1,'
        '"args":{"group":"world","call":0}}\n]'
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    picture = tmp_path / "trace.png"
    code = main(["trace", str(tmp_path), "--png", str(picture)])
    said = capsys.readouterr()
    assert code == 1
    assert "pip install matplotlib" in said.err and f"--png {picture}" in said.err
    assert (tmp_path / "trace.json").exists() and not picture.exists()
