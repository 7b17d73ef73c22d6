"""``ferrodist.elastic`` with the pipeline: two pipelines of two stages, each stage's replicas
averaged by DDP, under ``ferrodist run -n 3:4``. A stage is lost (rank 3, killed); its
pipeline's other stage stands by while the other pipeline trains on alone from the last
commit; the replacement joins, gets its stage's commit from the stage's live replica, the
rank that stood by gets its stage's newest commit, and both pipelines train on. The model
at the end equals the unsplit model trained on the batches of the pipelines that trained
each step (the replay of the membership), and the replicas of each stage are equal to the
bit."""

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


@pytest.mark.timeout(240)
def test_a_lost_stage_is_replaced_and_the_pipelines_train_on_as_the_replay_of_their_membership(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", "3:4", str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 3's replacement starts" in done.stdout, done.stdout
    records = {}
    for f in tmp_path.glob("rank*.json"):
        record = json.loads(f.read_text())
        records[int(f.name[4:].split("-")[0])] = record
    assert sorted(records) == [0, 1, 2, 3], done.stdout
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
    expected = _replay(trained)
    got = params[0] + params[1]
    assert len(got) == len(expected)
    for p, q in zip(got, expected, strict=True):
        np.testing.assert_allclose(p, q, rtol=0, atol=1e-10)
