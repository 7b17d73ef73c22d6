"""The dtype table, reduce ops, and the error hierarchy."""

from __future__ import annotations

import pickle

import ml_dtypes
import numpy as np
import pytest

import ferrodist.core as core
from ferrodist.core import (
    ALL_DTYPES,
    BackendUnavailable,
    CollectiveMismatch,
    CollectiveTimeout,
    DeviceUnavailable,
    FerrodistError,
    InvalidArgument,
    InvalidRank,
    NotInitialized,
    PeerLost,
    ProtocolError,
    ReduceOp,
    check_op,
    dtype,
)

NCCL = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7}
NCCL |= {"float64": 8, "bfloat16": 9, "bool": 1}


def test_table_has_every_dtype_once_with_its_numpy_type_and_nccl_enum():
    names = [d.name for d in ALL_DTYPES]
    assert len(set(names)) == len(names)
    assert {"bool", "int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"} <= set(
        names
    )
    for d in ALL_DTYPES:
        assert dtype(d.name) is d and dtype(d.numpy) is d and dtype(d) is d
        assert d.nccl == NCCL.get(d.name)
        assert d.itemsize == d.numpy.itemsize
    assert dtype(ml_dtypes.bfloat16) is core.bfloat16
    assert dtype(np.float32) is core.float32
    assert pickle.loads(pickle.dumps(core.bfloat16)) is core.bfloat16


def test_ops_per_kind():
    for d in ALL_DTYPES:
        assert {ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX} <= d.ops
        assert (ReduceOp.AVG in d.ops) == d.is_floating
        assert (ReduceOp.BAND in d.ops) == (not d.is_floating)


def test_check_op_explains_what_to_do():
    with pytest.raises(InvalidArgument, match=r"rank 3: all_reduce: ReduceOp.BAND does not apply to float32.*integer"):
        check_op(ReduceOp.BAND, core.float32, operation="all_reduce", rank=3)
    with pytest.raises(InvalidArgument, match="AVG is defined for floating dtypes only"):
        check_op(ReduceOp.AVG, core.int32, operation="reduce")


def test_reduce_op_coercion():
    assert ReduceOp.coerce("max") is ReduceOp.MAX
    assert ReduceOp.coerce(ReduceOp.BXOR) is ReduceOp.BXOR
    with pytest.raises(InvalidArgument, match="SUM"):
        ReduceOp.coerce("mean")
    with pytest.raises(InvalidArgument):
        ReduceOp.coerce(0)


def test_avg_combines_as_sum_and_divides_once():
    """A step that combines part of the values (a node, a chunk) adds for AVG; only the
    divisor, applied once, makes it a mean. Every other op combines as itself."""
    assert ReduceOp.AVG.combine is ReduceOp.SUM and ReduceOp.AVG.divisor(4) == 4.0
    for op in ReduceOp:
        if op is not ReduceOp.AVG:
            assert op.combine is op and op.divisor(4) == 1.0


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (InvalidArgument, ValueError),
        (InvalidRank, ValueError),
        (NotInitialized, RuntimeError),
        (BackendUnavailable, RuntimeError),
        (DeviceUnavailable, RuntimeError),
        (CollectiveTimeout, TimeoutError),
        (PeerLost, ConnectionError),
        (ProtocolError, RuntimeError),
        (CollectiveMismatch, RuntimeError),
    ],
)
def test_every_error_is_a_ferrodist_error_and_a_builtin(cls, builtin):
    assert issubclass(cls, FerrodistError) and issubclass(cls, builtin)


def test_errors_keep_their_attributes_through_pickle_and_context():
    err = CollectiveTimeout("waited", rank=2, operation="recv", waiting_for=(0, 3))
    again = pickle.loads(pickle.dumps(err))
    assert (str(again), again.rank, again.operation, again.waiting_for) == ("waited", 2, "recv", (0, 3))
    lost = PeerLost("gone", peer=4)
    framed = lost.with_context("all_reduce #7", rank=1, operation="all_reduce")
    assert type(framed) is PeerLost and str(framed) == "all_reduce #7: gone"
    assert (framed.peer, framed.rank, framed.operation) == (4, 1, "all_reduce")
    assert str(lost) == "gone"
    assert pickle.loads(pickle.dumps(framed)).peer == 4


def test_context_names_the_rank_once():
    """A transport's message already starting with the rank ("rank 0: ...") and a call's
    context starting with it too: the framed message says "rank 0" once."""
    lost = PeerLost("rank 0: rank 1 went away (end of stream)", peer=1)
    framed = lost.with_context("rank 0: all_reduce #1 on group world (group rank 0 of 2)")
    assert str(framed) == "rank 0: all_reduce #1 on group world (group rank 0 of 2): rank 1 went away (end of stream)"
    other = PeerLost("rank 3: gone", peer=3).with_context("rank 0: recv #2")
    assert str(other) == "rank 0: recv #2: rank 3: gone"  # another rank's words keep their name
