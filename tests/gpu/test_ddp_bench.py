"""bench/gpu/ddp.py, the DDP benchmark tools/gpu_check.sh runs on a GPU machine, runs here
on the CPU with a tiny model (``--device cpu``): its three configurations train, its table
and JSON come out, and the three end with the same parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("ferrodist.torch", reason="ferrodist-torch is not installed (pip install packages/torch)")
pytest.importorskip("ferrodist.ddp", reason="ferrodist-ddp is not installed (pip install packages/ddp)")

ROOT = Path(__file__).resolve().parents[2]
#: Variables of an enclosing job that must not reach the launcher's ranks.
_PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FERRODIST_TOKEN")


def test_the_ddp_bench_compares_three_ddps_that_train_the_same_model(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in _PLACE}
    tiny = ["--features", "16", "--hidden", "32", "--classes", "8", "--batch", "4", "--steps", "2", "--warmup", "1"]
    out = tmp_path / "ddp.json"
    launcher = [sys.executable, "-m", "ferrodist.launch", "run", "-n", "2"]
    done = subprocess.run(
        [*launcher, str(ROOT / "bench/gpu/ddp.py"), "--device", "cpu", "--rounds", "1", *tiny, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("[rank 0] | ")]
    assert [line.removeprefix("[rank 0] | ").split(" | ")[0] for line in table[1:]] == [
        "ferrodist.ddp.DDP, ferrodist group (shm)",
        'torch DDP over "ferrodist" (shm)',
        "torch DDP over Gloo",
    ], done.stdout
    assert "(largest absolute difference allowed: 0): the same model" in done.stdout
    written = json.loads(out.read_text())
    assert written["device"] == "cpu" and written["ranks"] == 2
    assert written["parameters"] == 16 * 32 + 32 + 32 * 32 + 32 + 32 * 8 + 8
    assert [row["key"] for row in written["rows"]] == ["ferrodist_ddp", "torch_ddp_ferrodist", "torch_ddp_gloo"]
    assert all(row["median_s"] > 0 and len(row["rounds_s"]) == 1 for row in written["rows"])
    assert written["check"] == {
        "tolerance": 0.0,
        "max_abs_difference": {"ferrodist_ddp": 0.0, "torch_ddp_ferrodist": 0.0},
        "passed": True,
    }
