"""Tracing (``FERRODIST_TRACE=DIR``) on simulated worlds: every rank's collectives, messages,
DDP buckets and pipeline actions as Chrome trace events, and ``ferrodist trace``'s merge
naming the rank the others waited for."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import ferrodist.collectives as dist
from ferrodist.collectives import _trace, tracing
from ferrodist.core import CollectiveMismatch, GroupAborted, ReduceOp
from ferrodist.testing import run_world

launch_trace = pytest.importorskip("ferrodist.launch._trace", reason="ferrodist-launch is not installed")


@pytest.fixture
def trace_dir(tmp_path, monkeypatch):
    directory = tmp_path / "trace"
    monkeypatch.setenv(_trace.ENV, str(directory))
    yield directory
    _trace.close_all()


def events_of(directory, rank):
    return [e for e in launch_trace.load_rank_file(directory / f"rank-{rank}.json") if e.get("ph") == "X"]


def test_every_call_and_message_is_an_event_with_its_group_number_bytes_and_route(trace_dir):
    def rank_main():
        r = dist.get_rank()
        x = np.ones(100, np.float32)
        dist.all_reduce(x)
        dist.all_reduce(np.ones(8), ReduceOp.MAX, async_op=True).wait()
        dist.broadcast(np.zeros(3, np.int64), src=1)
        dist.barrier()
        pair = dist.new_group([0, 1])
        if r < 2:
            dist.all_reduce(np.ones(2), group=pair)
        if r == 0:
            dist.send(np.arange(5.0), 2, tag=7)
        elif r == 2:
            dist.recv(np.zeros(5), 0, tag=7)

    run_world(3, rank_main)
    _trace.close_all()
    for rank in range(3):
        events = events_of(trace_dir, rank)
        world = [e for e in events if e["cat"] == "collective" and e["args"]["group"] == "world"]
        assert [(e["name"], e["args"]["call"]) for e in world] == [
            ("all_reduce", 0),
            ("all_reduce", 1),
            ("broadcast", 2),
            ("barrier", 3),
        ]
        first = world[0]["args"]
        assert first["bytes"] == 400 and first["call_is"] == "all_reduce(float32 x 100, op=SUM)", first
        assert first["route"] == "recursive_doubling" and first["waited_for_turn_us"] >= 0
        assert world[1]["args"]["async"] is True
        assert all(e["dur"] >= 0 and e["ts"] > 0 for e in events)
        pair = [e for e in events if e["cat"] == "collective" and e["args"]["group"] != "world"]
        assert len(pair) == (1 if rank < 2 else 0)
    (sent,) = [e for e in events_of(trace_dir, 0) if e["cat"] == "p2p"]
    (received,) = [e for e in events_of(trace_dir, 2) if e["cat"] == "p2p"]
    assert (sent["name"], sent["args"]["peer"], sent["args"]["tag"], sent["args"]["bytes"]) == ("send", 2, 7, 40)
    assert (received["name"], received["args"]["peer"], received["args"]["failed"]) == ("recv", 0, False)


def test_a_failed_call_is_in_the_trace_as_failed(trace_dir):
    def rank_main():
        with pytest.raises((CollectiveMismatch, GroupAborted)):
            dist.all_reduce(np.ones(4 if dist.get_rank() == 0 else 5), timeout=5)

    run_world(2, rank_main)
    _trace.close_all()
    for rank in range(2):
        (event,) = events_of(trace_dir, rank)
        assert event["args"]["failed"] is True


def test_off_nothing_is_written_and_no_tracer_exists(tmp_path, monkeypatch):
    monkeypatch.delenv(_trace.ENV, raising=False)

    def rank_main():
        dist.all_reduce(np.ones(4))
        return dist.default_group()._runner.tracer

    assert run_world(2, rank_main) == [None, None]
    assert not tracing.enabled()
    tracing.span(0, "ignored", "user", "t", tracing.now())  # records nothing, raises nothing
    assert not list(tmp_path.iterdir())


def test_ddp_buckets_and_pipeline_actions_are_on_the_timeline(trace_dir):
    nn = pytest.importorskip("ferrodist.nn")
    DDP = pytest.importorskip("ferrodist.ddp").DDP
    pipeline = pytest.importorskip("ferrodist.pipeline")
    OneFOneB, Pipeline, split_sequential = pipeline.OneFOneB, pipeline.Pipeline, pipeline.split_sequential

    def model():
        return nn.Sequential(nn.Linear(4, 8, rng=1), nn.ReLU(), nn.Linear(8, 2, rng=2))

    def ddp_main():
        ddp = DDP(model(), bucket_cap_mb=0.0001)
        x = np.random.default_rng(dist.get_rank()).normal(size=(6, 4))
        loss = nn.MSELoss()
        for _ in range(2):
            out = ddp(x)
            loss(out, np.zeros_like(out))
            ddp.backward(loss.backward())

    def pipeline_main():
        stage = split_sequential(model(), 2)[dist.get_rank()]
        x = np.random.default_rng(0).normal(size=(8, 4))
        y = np.zeros((8, 2))
        Pipeline(stage, None, 4, OneFOneB()).train_step(x if dist.get_rank() == 0 else None, y, nn.MSELoss())

    run_world(2, ddp_main)
    run_world(2, pipeline_main)
    _trace.close_all()
    for rank in range(2):
        events = events_of(trace_dir, rank)
        buckets = [e for e in events if e["cat"] == "ddp" and e["name"].startswith("bucket")]
        assert len(buckets) >= 4 and all(e["args"]["bytes"] > 0 for e in buckets)
        assert [e["name"] for e in events if e["cat"] == "ddp" and not e["name"].startswith("bucket")] == [
            "backward",
            "wait for buckets",
        ] * 2
        actions = [e["name"] for e in events if e["cat"] == "pipeline"]
        assert sorted(actions) == sorted(f"{kind}{i}" for kind in ("F", "BW") for i in range(4)), actions


def test_the_merge_names_the_rank_the_others_waited_for(trace_dir, tmp_path):
    def rank_main():
        for step in range(3):
            if dist.get_rank() == 2 and step == 1:
                time.sleep(0.2)  # rank 2 is late to call #1
            dist.all_reduce(np.ones(16))

    run_world(3, rank_main)
    _trace.close_all()
    merged = launch_trace.merge(trace_dir)
    data = json.loads(merged.path.read_text())
    assert {e["pid"] for e in data["traceEvents"] if e.get("ph") == "X"} == {0, 1, 2}
    assert min(e["ts"] for e in data["traceEvents"] if "ts" in e) == 0
    top = merged.late[0]
    assert (top.group, top.call, top.operation, top.last_rank) == ("world", 1, "all_reduce", 2)
    assert top.waited_us >= 150_000
    text = launch_trace.summary(merged)
    assert "| world | #1 | all_reduce | 2 |" in text and "rank 2: last in" in text
    pytest.importorskip("matplotlib")
    png = tmp_path / "trace.png"
    launch_trace.render_png(merged, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rank_file_cut_short_still_merges(tmp_path):
    (tmp_path / "rank-0.json").write_text(
        '[{"name":"process_name","ph":"M","pid":0,"tid":0,"args":{"name":"rank 0"}}\n'
        ',{"name":"all_reduce","cat":"collective","ph":"X","ts":10,"dur":5,"pid":0,"tid":1,"args":{"group":"world","call":0}}\n'
        ',{"name":"all_red'
    )
    merged = launch_trace.merge(tmp_path)
    assert merged.events == 1
