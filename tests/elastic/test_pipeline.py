"""``ferrodist.elastic`` with the pipeline: two pipelines of two stages, each stage's replicas
averaged by DDP, under ``ferrodist run -n 3:4``. A stage is lost (rank 3, killed); its
pipeline's other stage stands by while the other pipeline trains on alone from the last
commit; the replacement joins, gets its stage's commit from the stage's live replica, the
rank that stood by gets its stage's newest commit, and both pipelines train on. The model
at the end equals the unsplit model trained on the batches of the pipelines that trained
each step (the replay of the membership), and the replicas of each stage are equal to the
bit. A pipeline without replicas (``State(backup=True)``) loses its last stage: the first
stands by until the replacement joins, which gets the stage's commit from the copy the first
kept; the model equals the replay."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ferrodist import nn

SCRIPT = Path(__file__).parent / "scripts" / "pipeline.py"


def _script():
    spec = importlib.util.spec_from_file_location("elastic_pipeline_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _replay(trained: dict[str, list[int]]) -> list[np.ndarray]:
    """The unsplit model trained, step by step, on the batches of the pipelines that trained
    that step (DDP's average of two pipelines' mean losses is the mean over both batches)."""
    script = _script()
    net = script.model()
    opt, loss_fn = nn.SGD(net.parameters(), lr=0.05), nn.MSELoss()
    for step in range(script.STEPS):
        parts = [script.batch(step, line) for line in trained[str(step)]]
        x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        loss_fn(net(x), y)
        net.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    return [p.data for p in net.parameters()]


def _job(tmp_path, shape: str, pipelines: int) -> dict[int, dict]:
    """scripts/pipeline.py under ``ferrodist run -n SHAPE``: each rank's record, by rank."""
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", shape, str(SCRIPT), str(tmp_path), str(pipelines)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"rank {2 * pipelines - 1}'s replacement starts" in done.stdout, done.stdout
    records = {int(f.name[4:].split("-")[0]): json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")}
    assert sorted(records) == list(range(2 * pipelines)), done.stdout
    return records


def _assert_replayed(records: dict[int, dict]) -> None:
    """Stages 0 and 1 (ranks 0 and 1) together equal the replay of rank 0's record."""
    expected = _replay(records[0]["trained"])
    got = [np.array(p) for p in records[0]["params"] + records[1]["params"]]
    assert len(got) == len(expected)
    for p, q in zip(got, expected, strict=True):
        np.testing.assert_allclose(p, q, rtol=0, atol=1e-10)


@pytest.mark.timeout(240)
def test_a_lost_stage_is_replaced_and_the_pipelines_train_on_as_the_replay_of_their_membership(tmp_path):
    records = _job(tmp_path, "3:4", 2)
    assert records[3]["replacement"] and all(r["ranks"] == [0, 1, 2, 3] for r in records.values())
    # rank 0 trained on throughout: after the loss, pipeline 0 alone from the commit of step 10,
    # then both again from the commit point where the replacement joined
    calls = records[0]["calls"]
    assert [c[1] for c in calls] == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3]] and calls[1][0] == 10, calls
    trained = records[0]["trained"]
    joined = calls[2][0]
    assert [trained[str(s)] for s in range(10, joined)] == [[0]] * (joined - 10), trained
    assert all(trained[str(s)] == [0, 1] for s in [*range(10), *range(joined, 40)]), trained
    # the replicas of each stage are equal to the bit; together the stages are the replay's model
    params = {rank: [np.array(p) for p in r["params"]] for rank, r in records.items()}
    for a, b in ((0, 2), (1, 3)):
        assert all(np.array_equal(p, q) for p, q in zip(params[a], params[b], strict=True)), (a, b)
    _assert_replayed(records)


@pytest.mark.timeout(240)
def test_a_pipeline_without_replicas_gets_its_lost_stage_back_from_the_copy_a_peer_kept(tmp_path):
    records = _job(tmp_path, "1:2", 1)
    assert records[1]["replacement"] and all(r["ranks"] == [0, 1] for r in records.values())
    calls = records[0]["calls"]  # alone from the commit of step 10, standing by; both again from there
    assert calls == [[0, [0, 1]], [10, [0]], [10, [0, 1]]], calls
    assert records[0]["trained"] == {str(s): [0] for s in range(40)}
    _assert_replayed(records)
