"""Call fingerprints: distinct calls differ, and a fingerprint reads back as words."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrodist.collectives._fingerprint import OPERATIONS, describe, fingerprint
from ferrodist.core import ALL_DTYPES, ReduceOp, float32, int8, uint8

calls = st.tuples(
    st.sampled_from(OPERATIONS),
    st.sampled_from(ALL_DTYPES),
    st.integers(0, (1 << 38) - 1),
    st.sampled_from([None, *ReduceOp]),
    st.one_of(st.none(), st.integers(0, 2045)),
    st.booleans(),
)


@given(a=calls, b=calls)
def test_different_calls_have_different_fingerprints(a, b):
    """Operation, dtype, count, op, root and route each change the fingerprint."""
    assert (fingerprint(*a[:-1], direct=a[-1]) == fingerprint(*b[:-1], direct=b[-1])) == (a == b)
    assert fingerprint(*a[:-1], direct=a[-1]) != 0


def test_descriptions():
    assert describe(fingerprint("all_reduce", float32, 100, ReduceOp.SUM)) == "all_reduce(float32 x 100, op=SUM)"
    assert describe(fingerprint("broadcast", int8, 5, root=3)) == "broadcast(int8 x 5, root=3)"
    assert describe(fingerprint("barrier")) == "barrier()"
    assert describe(fingerprint("gather", int8, 1, root=5000)) == "gather(int8 x 1, root>=2046)"
    assert describe(7).startswith("an unknown call")
    direct = fingerprint("all_reduce", float32, 8, ReduceOp.AVG, direct=True)
    assert describe(direct) == "all_reduce(float32 x 8, op=AVG, device to device through NCCL)"
    assert describe(fingerprint("cuda_route", uint8, 512)) == "cuda_route(uint8 x 512)"


@pytest.mark.parametrize("operation", OPERATIONS)
def test_every_operation_reads_back(operation):
    assert describe(fingerprint(operation)).startswith(operation + "(")
