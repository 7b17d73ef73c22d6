"""bench/gpu/all_reduce.py, the script tools/gpu_check.sh runs on a GPU machine, runs here
on the CUDA simulator, prints its table and writes its rows as JSON (so that it still works
when a GPU comes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ferrodist.gpu")
ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_all_reduce_bench_prints_one_row_per_size(tmp_path):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", FERRODIST_GPU_SEGMENT_BYTES="4096")
    launcher = [sys.executable, "-m", "ferrodist.launch", "run", "-n", "2"]
    args = ["--sizes", "4K,16K", "--reps", "2", "--rounds", "1", "--json", str(tmp_path / "all_reduce.json")]
    done = subprocess.run(
        [*launcher, str(ROOT / "bench/gpu/all_reduce.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 processes sharing 1 GPU(s) (Numba's CUDA simulator)" in done.stdout
    rows = re.findall(
        r"\[rank 0\] \| (4 KiB|16 KiB) \| [\d.]+ (?:us|ms) \| [\d.]+ (?:us|ms) \| ([\d.]+) \|", done.stdout
    )
    assert [size for size, _ in rows] == ["4 KiB", "16 KiB"], done.stdout
    assert all(float(ratio) > 0 for _, ratio in rows)
    written = json.loads((tmp_path / "all_reduce.json").read_text())
    assert written["processes"] == 2 and written["dtype"] == "float32"
    assert [row["size"] for row in written["rows"]] == ["4 KiB", "16 KiB"]
    assert [f"{row['ferrodist_per_floor']:.2f}" for row in written["rows"]] == [ratio for _, ratio in rows]
    assert all(row["gloo_s"] is None for row in written["rows"])  # no Gloo column on the simulator
