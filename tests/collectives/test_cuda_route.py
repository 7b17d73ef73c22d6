"""The choice of a group's CUDA engine as a value: every rank decides the same from what all
ranks said (``_device.choose``), without a GPU or a byte moved.

Example counts (CI profile): records round-trip 100; choose against its rules 300.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import examples
from ferrodist.collectives._device import ROUTES, Choice, Record, choose, requested_route
from ferrodist.core import DeviceUnavailable, InvalidArgument, Probe


def record(requested="auto", usable=True, device=b"gpu", version=22809, staged=True, reason=""):
    return Record(requested, staged, Probe(usable, reason if not usable else "", device if usable else b"", version))


probes = st.builds(
    Probe,
    usable=st.booleans(),
    reason=st.text(max_size=300),
    device=st.binary(max_size=40),
    version=st.integers(0, 2**31 - 1),
)
records = st.builds(Record, requested=st.sampled_from(ROUTES), staged=st.booleans(), nccl=probes)


@settings(max_examples=examples(100))
@given(rec=records)
def test_a_record_travels_in_its_256_bytes(rec):
    back = Record.decode(rec.encode())
    assert back.requested == rec.requested and back.staged == rec.staged
    assert back.nccl.usable == rec.nccl.usable and back.nccl.version == rec.nccl.version
    assert back.nccl.device == rec.nccl.device[:32]
    assert rec.nccl.reason.encode()[:208].decode(errors="replace") == back.nccl.reason


def _every_rank_can(recs):
    devices = [r.nccl.device for r in recs]
    return (
        all(r.nccl.usable for r in recs)
        and len(set(devices)) == len(devices)
        and len({r.nccl.version for r in recs}) == 1
    )


@settings(max_examples=examples(300))
@given(
    world=st.lists(
        st.tuples(st.booleans(), st.integers(0, 3), st.sampled_from([22809, 22809, 21803]), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    asked=st.sampled_from(ROUTES),
)
def test_choose_follows_its_rules(world, asked):
    """NCCL exactly when every rank can (a GPU of its own, one NCCL release) and none asked
    for staged; a forced route that cannot run, or a missing staged engine where it is
    needed, raises; the same records always give the same answer."""
    recs = [record(asked, usable, f"gpu{gpu}".encode(), version, staged) for usable, gpu, version, staged in world]
    nccl = asked != "staged" and _every_rank_can(recs)
    if asked == "nccl" and not nccl:
        with pytest.raises(DeviceUnavailable, match="'nccl' was asked for but cannot run"):
            choose(recs)
    elif not nccl and not all(r.staged for r in recs):
        with pytest.raises(
            DeviceUnavailable, match=r"pip install -e ./packages/gpu \(from a clone of ferrodist\) on every rank"
        ):
            choose(recs)
    else:
        choice = choose(recs)
        assert choice.engine == ("nccl" if nccl else "staged")
        assert choose(list(recs)) == choice


def test_reasons_name_the_ranks():
    shared = [record(device=b"a"), record(device=b"b"), record(device=b"a")]
    assert choose(shared) == Choice(
        "staged", "not every rank can run NCCL: ranks [0, 2] share one GPU (NCCL needs a GPU per rank)"
    )
    missing = [record(), record(usable=False, reason="no GPU here")]
    assert choose(missing).reason == "not every rank can run NCCL: rank 1 cannot: no GPU here"
    releases = [record(device=b"a", version=22809), record(device=b"b", version=21803)]
    assert "different NCCL releases (21803, 22809)" in choose(releases).reason
    assert choose([record(device=b"a"), record(device=b"b")]) == Choice(
        "nccl", "every rank has its own GPU and NCCL 22809"
    )
    assert choose([record("staged"), record("staged")]) == Choice("staged", "asked for")
    with pytest.raises(DeviceUnavailable, match=r"rank 1 cannot: no GPU here; fix that, or ask for cuda_route='auto'"):
        choose([record("nccl"), record("nccl", usable=False, reason="no GPU here")])


def test_ranks_asking_for_different_routes_are_named():
    with pytest.raises(InvalidArgument, match=r"ranks \[0, 2\] asked for 'auto'; rank 1 asked for 'nccl'"):
        choose([record("auto"), record("nccl"), record("auto")])


def test_the_route_asked_for(monkeypatch):
    monkeypatch.delenv("FERRODIST_CUDA_ROUTE", raising=False)
    assert requested_route(None) == "auto"
    assert requested_route(" NCCL ") == "nccl"
    monkeypatch.setenv("FERRODIST_CUDA_ROUTE", "staged")
    assert requested_route(None) == "staged"
    monkeypatch.setenv("FERRODIST_CUDA_ROUTE", "gloo")
    with pytest.raises(
        InvalidArgument, match=r"rank 3: FERRODIST_CUDA_ROUTE='gloo' is not a CUDA route; use one of auto, nccl, staged"
    ):
        requested_route(None, rank=3)
