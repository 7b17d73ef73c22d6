"""Bucket plans as values: every parameter placed once, caps kept, reverse order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import examples

pytest.importorskip("ferrodist.ddp", reason="ferrodist-ddp is not installed (pip install packages/ddp)")
from ferrodist.ddp import ParamSpec, plan_buckets

ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2}


@st.composite
def param_lists(draw):
    count = draw(st.integers(1, 30))
    out = []
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
        dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
        out.append(ParamSpec(f"p{i}", shape, dtype, ITEMSIZE[dtype]))
    return out


@settings(max_examples=examples(200), deadline=None)
@given(params=param_lists(), cap_kb=st.integers(1, 64), first_kb=st.integers(1, 64))
def test_plan_invariants(params, cap_kb, first_kb):
    plan = plan_buckets(params, cap_mb=cap_kb / 1024, first_cap_mb=first_kb / 1024)
    placed = [p for b in plan.buckets for p in b.params]
    assert sorted(placed) == list(range(len(params)))  # every parameter exactly once
    for index, b in enumerate(plan.buckets):
        assert b.index == index
        assert list(b.params) == sorted(b.params, reverse=True)  # reverse registration order inside
        assert {params[p].dtype for p in b.params} == {b.dtype}  # one dtype per bucket
        offset = 0
        for p, off, numel, shape in zip(b.params, b.offsets, b.numels, b.shapes, strict=True):
            assert off == offset and numel == params[p].numel and shape == params[p].shape  # packed, no overlap
            offset += numel
        assert b.numel == offset and b.nbytes == offset * ITEMSIZE[b.dtype]
        # a bucket is closed as soon as it reaches its cap: without its last parameter it was below it
        cap = plan.first_cap_bytes if index == 0 else plan.cap_bytes
        assert b.nbytes - params[b.params[-1]].nbytes < max(cap, plan.cap_bytes)
        if len(b.params) > 1:  # a parameter as large as the cap has a bucket of its own
            assert all(params[p].nbytes < plan.cap_bytes for p in b.params), b
    # buckets start in the order backward finishes their first gradient
    firsts = [b.params[0] for b in plan.buckets]
    assert firsts == sorted(firsts, reverse=True)
    assert plan.where(placed[0])[1] == 0


def test_a_small_first_bucket_then_the_cap():
    params = [ParamSpec(f"w{i}", (256, 256), "float32", 4) for i in range(8)]  # 256 KiB each
    plan = plan_buckets(params, cap_mb=1.0, first_cap_mb=0.25)
    print(plan.describe())
    assert [b.names for b in plan.buckets] == [("w7",), ("w6", "w5", "w4", "w3"), ("w2", "w1", "w0")]
    assert "bucket 0: float32 on cpu, 65536 elements (0.25 MiB): w7" in plan.describe()


def test_a_parameter_larger_than_the_cap_does_not_share_its_bucket():
    """PyTorch's large weights get buckets of their own, so DDP averages their gradients
    where autograd left them (no copy into a shared buffer)."""
    params = [ParamSpec("w", (1024, 1024), "float32", 4), ParamSpec("b", (1024,), "float32", 4)]
    plan = plan_buckets(params, cap_mb=1.0, first_cap_mb=1.0)
    assert [b.names for b in plan.buckets] == [("b",), ("w",)]


def test_dtypes_get_buckets_of_their_own():
    params = [
        ParamSpec("a", (4,), "float32", 4),
        ParamSpec("b", (4,), "float64", 8),
        ParamSpec("c", (4,), "float32", 4),
    ]
    plan = plan_buckets(params)
    assert [b.names for b in plan.buckets] == [("c", "a"), ("b",)]


def test_bad_caps_are_refused():
    import pytest

    with pytest.raises(ValueError, match="positive"):
        plan_buckets([ParamSpec("a", (1,), "float32", 4)], cap_mb=0)
