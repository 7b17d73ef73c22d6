"""`ferrodist run --max-restarts N`: a job whose rank dies starts again with a new
rendezvous, and a script that resumes from its checkpoint ends as an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import free_port

pytest.importorskip("ferrodist.ddp", reason="ferrodist-ddp is not installed (pip install packages/ddp)")

SCRIPT = Path(__file__).parent / "scripts" / "resumable.py"


def ferrodist_run(tmp_path: Path, *options: str, kill: int, name: str) -> tuple[subprocess.CompletedProcess, dict]:
    checkpoint = tmp_path / f"{name}.ckpt"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferrodist.launch",
            "run",
            "-n",
            "2",
            *options,
            str(SCRIPT),
            str(checkpoint),
            "12",
            "4",
            str(kill),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
    )
    rows = {}
    for line in done.stdout.splitlines():
        if '"params"' in line:
            row = json.loads(line.split("] ", 1)[1])
            rows[row["rank"]] = row
    return done, rows


def test_a_killed_rank_restarts_the_job_which_resumes_and_ends_as_an_uninterrupted_run(tmp_path):
    done, rows = ferrodist_run(tmp_path, "--max-restarts", "1", kill=6, name="restarted")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ferrodist run: restarting the job (1 of 1 restarts)" in done.stdout, done.stdout
    assert sorted(rows) == [0, 1]
    assert all(row["restart"] == 1 and row["start"] == 4 for row in rows.values())  # from the step-4 checkpoint
    whole, reference = ferrodist_run(tmp_path, kill=-1, name="whole")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert all(row["restart"] == 0 and row["start"] == 0 for row in reference.values())
    for rank in (0, 1):
        assert rows[rank]["params"] == reference[rank]["params"]  # bit for bit


def test_without_restarts_left_the_failure_ends_the_job(tmp_path):
    done, rows = ferrodist_run(tmp_path, kill=6, name="once")
    assert done.returncode == 128 + 9, done.stdout + done.stderr  # rank 1's SIGKILL
    assert "restarting" not in done.stdout and rows == {}
    assert "rank 1" in done.stdout


def test_a_job_that_fails_on_every_attempt_says_when_its_restarts_are_spent(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", "1", "--max-restarts", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
    )
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    restarts = [i for i, line in enumerate(lines) if "ferrodist run: restarting the job" in line]
    spent = [i for i, line in enumerate(lines) if "ferrodist run: no restart left (2 of 2 used): the job ends" in line]
    assert len(restarts) == 2 and len(spent) == 1 and spent[0] > restarts[-1], done.stdout


def test_a_bad_restart_count_is_refused(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", "1", "--max-restarts", "-1", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--max-restarts must be a whole number >= 0" in done.stderr, done.stderr


def test_every_node_restarts_when_a_rank_on_another_node_dies(tmp_path):
    """Two launchers (nodes 0 and 1 on this machine, one rank each): rank 1, on node 1, is
    killed; both launchers get the same verdict, meet again and start the job again."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["FERRODIST_TOKEN"] = "restarts-test"
    checkpoint = tmp_path / "nodes.ckpt"
    job = ["--master-port", str(port), "-n", "1", "--max-restarts", "1", str(SCRIPT), str(checkpoint), "12", "4", "6"]
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "ferrodist.launch", "run", "--nnodes", "2", "--node-rank", str(node), *job],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in (1, 0)
    ]
    outputs = [proc.communicate(timeout=180)[0] for proc in launchers]
    rows = [json.loads(line.split("] ", 1)[1]) for out in outputs for line in out.splitlines() if '"params"' in line]
    for proc, out in zip(launchers, outputs, strict=True):
        assert proc.returncode == 0, out
        assert "rank 1 was killed by SIGKILL" in out and "restarting the job (1 of 1 restarts)" in out, out
    assert sorted(row["rank"] for row in rows) == [0, 1]
    assert all(row["restart"] == 1 and row["start"] == 4 for row in rows)
    assert rows[0]["params"] == rows[1]["params"]  # the replicas agree after the restart


def test_a_lost_node_is_waited_for_and_its_new_launcher_joins_the_restart(tmp_path):
    """Node 1's launcher is killed (by its rank, at step 6 of the first start); node 0's
    launcher restarts the job and waits for node 1; a launcher started again for node 1
    joins that restart, and both ranks resume from the step-4 checkpoint and end as an
    uninterrupted run does."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["FERRODIST_TOKEN"] = "lost-node-test"
    checkpoint = tmp_path / "lost.ckpt"
    job = ["--master-port", str(port), "-n", "1", "--max-restarts", "1", "--join-timeout", "60"]
    job += [str(SCRIPT), str(checkpoint), "12", "4", "6", "launcher"]

    def launcher(node: int) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "ferrodist.launch", "run", "--nnodes", "2", "--node-rank", str(node), *job]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    first, node0 = launcher(1), launcher(0)
    lost = first.communicate(timeout=120)[0]
    assert first.returncode == -9, lost
    again = launcher(1)
    outputs = [node0.communicate(timeout=120)[0], again.communicate(timeout=120)[0]]
    assert [node0.returncode, again.returncode] == [0, 0], outputs
    assert (
        "restarting the job (1 of 1 restarts): every rank starts again with a new rendezvous; waiting up to "
        "60 s for node 1's launcher" in outputs[0]
    ), outputs[0]
    rows = [json.loads(line.split("] ", 1)[1]) for out in outputs for line in out.splitlines() if '"params"' in line]
    assert sorted(row["rank"] for row in rows) == [0, 1]
    assert all(row["restart"] == 1 and row["start"] == 4 for row in rows), (
        rows
    )  # node 1's new launcher joined attempt 1
    _, reference = ferrodist_run(tmp_path, kill=-1, name="whole")
    for row in rows:
        assert row["params"] == reference[row["rank"]]["params"]
