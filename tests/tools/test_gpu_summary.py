"""tools/gpu_summary.py and tools/gpu_check.sh without a GPU: a pytest step that segfaults
keeps its counts and names the test that was running; the benchmarks' JSON become the
table's rows; a step that failed or wrote nothing fails the summary; and without a GPU the
check stops after the versions with one clear line."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gpu_summary

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = [sys.executable, str(ROOT / "tools/gpu_summary.py")]

A_STEP = textwrap.dedent(
    """
    import ctypes
    import pytest

    def test_one(): pass
    def test_two(): pass
    def test_skipped(): pytest.skip("not here")
    def test_wrong(): assert 1 == 2
    @pytest.fixture
    def broken(): raise RuntimeError("setup")
    def test_broken_setup(broken): pass
    def test_segfault(): ctypes.string_at(0)
    def test_never_reached(): pass
    """
)


def write_steps(results: Path, *lines: tuple[str, str, str]) -> None:
    (results / "steps.tsv").write_text("".join("\t".join(line) + "\n" for line in lines))


def summary(results: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SUMMARY, str(results)], capture_output=True, text=True, timeout=60)


def table(stdout: str) -> list[list[str]]:
    """The summary table's rows (below its header), as cells."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ")][1:]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def test_a_pytest_step_that_segfaults_keeps_its_counts_and_names_the_test(tmp_path):
    (tmp_path / "test_step.py").write_text(A_STEP)
    results = tmp_path / "results"
    results.mkdir()
    env = dict(os.environ, FERRODIST_GPU_REPORT=str(results / "tests-a.jsonl"), PYTHONPATH=str(ROOT / "tools"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "gpu_summary", "-p", "no:cacheprovider", "test_step.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -11, done.stdout + done.stderr  # killed by SIGSEGV
    write_steps(results, ("tests-a", str(128 + 11), "pytest test_step.py"), ("tests-b", "0", "pytest other"))
    shown = summary(results)
    assert shown.returncode == 1
    rows = table(shown.stdout)
    assert rows[0][:3] == [
        "tests-a",
        "CRASHED (signal 11, SIGSEGV) while running test_step.py::test_segfault",
        "2 passed, 1 failed, 1 skipped, 1 errors",
    ]
    assert rows[1][:3] == ["tests-b", "ok", "no test results (no event file)"]
    assert "  test_step.py::test_wrong" in shown.stdout
    assert "  test_step.py::test_broken_setup (error in setup)" in shown.stdout
    assert "  tests-a: pytest test_step.py" in shown.stdout  # how to rerun it
    assert "verdict: FAILED" in shown.stdout


def test_counts_follow_pytest_for_collection_errors_and_an_unfinished_run(tmp_path):
    events = [
        {"event": "collect", "nodeid": "tests/torch/test_backend.py", "outcome": "failed"},
        {"event": "start", "nodeid": "t.py::a"},
        {"event": "report", "nodeid": "t.py::a", "when": "setup", "outcome": "passed", "xfail": False},
        {"event": "report", "nodeid": "t.py::a", "when": "call", "outcome": "passed", "xfail": False},
        {"event": "report", "nodeid": "t.py::a", "when": "teardown", "outcome": "failed", "xfail": False},
    ]
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps(event) + "\n" for event in events) + '{"event": "sta')  # cut by a crash
    counts = gpu_summary.count(path)
    assert counts is not None
    assert (counts.passed, counts.failed, counts.skipped, counts.errors) == (1, 0, 0, 2)
    assert counts.failures == ["tests/torch/test_backend.py (collection error)", "t.py::a (error in teardown)"]
    assert counts.running is None and not counts.finished


def test_the_benchmarks_rows_make_one_table(tmp_path):
    all_reduce = {
        "dtype": "float32",
        "rows": [
            {
                "size": "4 KiB",
                "ferrodist_s": 2e-4,
                "floor_s": 1e-4,
                "ferrodist_per_floor": 2.0,
                "gloo_s": 3e-4,
                "gloo_per_ferrodist": 1.5,
            }
        ],
    }
    kernels = {
        "rows": [
            {
                "dtype": "float32",
                "ours_gbps": 1000.0,
                "torch_gbps": 2000.0,
                "ratio": 0.5,
                "same_bits": True,
                "error": None,
            },
            {
                "dtype": "bfloat16",
                "ours_gbps": None,
                "torch_gbps": None,
                "ratio": None,
                "same_bits": None,
                "error": "E",
            },
        ]
    }
    ddp = {
        "rows": [
            {"key": "ferrodist_ddp", "configuration": "ferrodist.ddp.DDP", "median_s": 0.02, "gloo_per_this": 2.0},
            {"key": "torch_ddp_gloo", "configuration": "torch DDP over Gloo", "median_s": 0.04, "gloo_per_this": 1.0},
        ],
        "check": {"tolerance": 0.0, "max_abs_difference": {"ferrodist_ddp": 0.0}, "passed": True},
    }
    for name, data in (("bench-all-reduce", all_reduce), ("bench-kernels", kernels), ("bench-ddp", ddp)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "machine.json").write_text(json.dumps({"python": "3.12.3", "gpu": "A GPU"}))
    write_steps(
        tmp_path,
        ("bench-all-reduce", "0", "ferrodist run -n 2 bench/gpu/all_reduce.py"),
        ("bench-kernels", "1", "python bench/gpu/kernels.py"),
        ("bench-ddp", "0", "ferrodist run -n 2 bench/gpu/ddp.py"),
        ("bench-extra", "skip: torch with CUDA is not installed", ""),
    )
    shown = summary(tmp_path)
    assert shown.returncode == 1  # the kernels step failed
    assert "== summary (python 3.12.3, gpu A GPU)" in shown.stdout
    assert table(shown.stdout) == [
        ["bench-all-reduce", "ok", "4 KiB float32", "200 us", "floor 100 us", "2.00", "300 us", "1.50x"],
        ["bench-kernels", "FAILED (exit 1)", "float32", "1000 GB/s", "torch add_ 2000 GB/s", "0.50", "", ""],
        ["", "", "bfloat16", "failed: E", "", "", "", ""],
        ["bench-ddp", "ok", "ferrodist.ddp.DDP", "20.000 ms", "", "", "40.000 ms", "2.00x"],
        ["", "", "parameters vs torch DDP over Gloo", "bit-equal (allowed 0): same model", "", "", "", ""],
        ["bench-extra", "skipped: torch with CUDA is not installed", "", "", "", "", "", ""],
    ]


def test_a_benchmark_that_wrote_no_rows_fails_the_summary(tmp_path):
    write_steps(tmp_path, ("bench-all-reduce", "0", "ferrodist run -n 2 bench/gpu/all_reduce.py"))
    shown = summary(tmp_path)
    assert shown.returncode == 1
    assert table(shown.stdout)[0][:3] == ["bench-all-reduce", "ok; it wrote no bench-all-reduce.json", "no rows"]


def test_every_step_passing_passes(tmp_path):
    (tmp_path / "tests-a.jsonl").write_text(
        '{"event": "report", "nodeid": "t.py::a", "when": "call", "outcome": "passed"}\n'
        '{"event": "finish", "exitstatus": 0}\n'
    )
    write_steps(tmp_path, ("tests-a", "0", "pytest t.py"))
    shown = summary(tmp_path)
    assert shown.returncode == 0, shown.stdout
    assert "verdict: every step passed" in shown.stdout


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_driver_loads(), reason="a CUDA driver loads here: the check would run in full")
def test_the_gpu_check_stops_after_the_versions_without_a_gpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, INSTALL="0", RESULTS=str(tmp_path))
    done = subprocess.run(
        ["bash", str(ROOT / "tools/gpu_check.sh")], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "== what this machine has" in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("no usable CUDA GPU (") and last.endswith(
        "this check needs one and stops here; on a CPU machine run make test"
    ), done.stderr
    assert not (tmp_path / "steps.tsv").exists()  # no test or benchmark ran
