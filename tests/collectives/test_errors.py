"""Every bad argument to a collective is refused before a byte moves, with a message that
names the rank, the operation and what to do; the group keeps working afterwards."""

from __future__ import annotations

import numpy as np
import pytest

import ferrodist.collectives as dist
from ferrodist.core import InvalidArgument, InvalidRank, ReduceOp
from ferrodist.testing import run_world

F32 = np.float32


def frozen(a):
    a = np.array(a)
    a.flags.writeable = False
    return a


# (name, call(rank), exception, message). Each runs on every rank of a 2-rank world and
# must fail on rank 0 *before sending anything*; afterwards a collective must still work.
CASES = [
    (
        "float BAND",
        lambda r: dist.all_reduce(np.zeros(2, F32), ReduceOp.BAND),
        InvalidArgument,
        r"rank 0: all_reduce: ReduceOp.BAND does not apply to float32",
    ),
    (
        "int AVG",
        lambda r: dist.all_reduce(np.zeros(2, np.int64), "avg"),
        InvalidArgument,
        r"AVG is defined for floating dtypes only",
    ),
    (
        "unknown op",
        lambda r: dist.all_reduce(np.zeros(2), "mean"),
        InvalidArgument,
        r"rank 0: all_reduce: 'mean' is not a reduce op",
    ),
    ("read-only all_reduce", lambda r: dist.all_reduce(frozen([1.0])), InvalidArgument, r"read-only"),
    (
        "list input",
        lambda r: dist.all_reduce([1.0, 2.0]),
        InvalidArgument,
        r"rank 0: all_reduce: tensor: as_tensor cannot view a list",
    ),
    ("non-contiguous", lambda r: dist.all_reduce(np.zeros((3, 3))[:, 0]), InvalidArgument, r"not C-contiguous"),
    (
        "bad algorithm",
        lambda r: dist.all_reduce(np.zeros(2), algorithm="star"),
        InvalidArgument,
        r"algorithm='star' is unknown",
    ),
    (
        "bad timeout",
        lambda r: dist.all_reduce(np.zeros(2), timeout=-1),
        InvalidArgument,
        r"timeout must be a positive number",
    ),
    ("broadcast root out of range", lambda r: dist.broadcast(np.zeros(2), src=2), InvalidRank, r"not in group world"),
    (
        "group-rank root out of range",
        lambda r: dist.new_group().broadcast(np.zeros(2), src=5),
        InvalidRank,
        r"src=5 is outside the group \(valid: 0..1\)",
    ),
    (
        "root not an int",
        lambda r: dist.new_group().reduce(np.zeros(2), dst="0"),
        InvalidRank,
        r"dst must be an integer rank",
    ),
    ("broadcast into read-only", lambda r: dist.broadcast(frozen([1.0]), src=1), InvalidArgument, r"read-only"),
    (
        "all_gather list length",
        lambda r: dist.all_gather([np.zeros(2)], np.zeros(2)),
        InvalidArgument,
        r"output has 1 entries but the group has 2 ranks",
    ),
    (
        "all_gather dtype",
        lambda r: dist.all_gather([np.zeros(2, F32), np.zeros(2)], np.zeros(2)),
        InvalidArgument,
        r"output\[0\] is float32 but the tensor is float64",
    ),
    (
        "all_gather tensor size",
        lambda r: dist.all_gather(np.zeros(5), np.zeros(2)),
        InvalidArgument,
        r"output has 5 elements; it needs group size x tensor elements = 2 x 2 = 4",
    ),
    (
        "all_gather element count",
        lambda r: dist.all_gather([np.zeros(3), np.zeros(2)], np.zeros(2)),
        InvalidArgument,
        r"output\[0\] has 3 elements but the tensor has 2",
    ),
    (
        "reduce_scatter input size",
        lambda r: dist.reduce_scatter(np.zeros(2), np.zeros(3)),
        InvalidArgument,
        r"input has 3 elements",
    ),
    (
        "reduce_scatter read-only output",
        lambda r: dist.reduce_scatter(frozen([0.0]), np.zeros(2)),
        InvalidArgument,
        r"output is read-only",
    ),
    (
        "gather list on non-root",
        lambda r: dist.gather(np.zeros(1), [np.zeros(1)] * 2, dst=1),
        InvalidArgument,
        r"gather_list is only used on the dst rank \(1\); pass None",
    ),
    (
        "gather list missing on root",
        lambda r: dist.gather(np.zeros(1), None, dst=0),
        InvalidArgument,
        r"gather_list is required on this rank",
    ),
    (
        "scatter list on non-root",
        lambda r: dist.scatter(np.zeros(1), [np.zeros(1)] * 2, src=1),
        InvalidArgument,
        r"scatter_list is only used on the src rank",
    ),
    (
        "scatter list missing on root",
        lambda r: dist.scatter(np.zeros(1), None, src=0),
        InvalidArgument,
        r"scatter_list is required",
    ),
    (
        "all_to_all lengths",
        lambda r: dist.all_to_all([np.zeros(1)], [np.zeros(1)] * 2),
        InvalidArgument,
        r"outputs has 1 entries",
    ),
    (
        "all_to_all split",
        lambda r: dist.all_to_all(np.zeros(3), np.zeros(4)),
        InvalidArgument,
        r"outputs has 3 elements, not divisible by the group size 2",
    ),
    (
        "all_to_all own block",
        lambda r: dist.all_to_all([np.zeros(2), np.zeros(1)], [np.zeros(1), np.zeros(1)]),
        InvalidArgument,
        r"inputs\[0\] \(kept by this rank\) has 1 elements but the tensor has 2",
    ),
    (
        "all_to_all dtypes",
        lambda r: dist.all_to_all([np.zeros(1, F32), np.zeros(1)], [np.zeros(1)] * 2),
        InvalidArgument,
        r"mix dtypes",
    ),
    ("send to self", lambda r: dist.send(np.zeros(1), dst=0), InvalidRank, r"peer 0 is this rank itself"),
    ("send bad tag", lambda r: dist.send(np.zeros(1), dst=1, tag=-3), InvalidArgument, r"tag must be an integer"),
    ("recv into read-only", lambda r: dist.recv(frozen([0.0]), src=1), InvalidArgument, r"read-only"),
    ("recv from outside", lambda r: dist.recv(np.zeros(1), src=7), InvalidRank, r"global rank 7 is not in group world"),
    (
        "group not a group",
        lambda r: dist.all_reduce(np.zeros(1), group="world"),
        InvalidArgument,
        r"group must be a ProcessGroup",
    ),
]


@pytest.mark.parametrize(("name", "call", "cls", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_arguments_fail_before_sending_and_leave_the_group_usable(name, call, cls, message):
    def rank_main():
        me = dist.get_rank()
        if me == 0:
            with pytest.raises(cls, match=message) as info:
                call(me)
            assert info.value.rank in (0, None)
        # Rank 1 called nothing. Had rank 0's refused call sent a byte or used up a call
        # number, the two ranks' next all_reduce would not match and would time out.
        x = np.array([me + 1.0])
        dist.all_reduce(x, timeout=10)
        assert dist.get_world_size() == 2
        return x[0]

    assert run_world(2, rank_main) == [3.0, 3.0]


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_barrier_a_rank_never_calls_times_out_saying_so_and_naming_it(kind):
    """Rank 0 calls barrier, rank 1 does not: the error matches torch's
    test_barrier_timeout_full_group (``" (Timed out|closed|timeout) "``) and names rank 1, on
    shared memory as on TCP; shared memory's says "timed out"."""
    import re
    import threading

    from _helpers import free_port
    from ferrodist.core import CollectiveTimeout
    from ferrodist.transport import ShmTransport, TcpTransport

    cls = ShmTransport if kind == "shm" else TcpTransport
    port = free_port()
    transports: list = [None, None]
    groups: list = [None, None]

    def join(rank: int) -> None:
        transports[rank] = t = cls.connect(
            rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=30, token=b"barrier-test"
        )
        groups[rank] = dist.ProcessGroup(t, range(2), 0, timeout=30, name="world")

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert all(g is not None for g in groups), "the 2-rank world did not start"
        with pytest.raises(CollectiveTimeout) as raised:
            groups[0].barrier(timeout=1.0)
        message = str(raised.value)
        assert kind != "shm" or "timed out" in message, message
        assert re.search(" (Timed out|closed|timeout) ", message), message
        assert re.search(r"ranks? \[?1\b", message), message
    finally:
        for t in transports:
            if t is not None:
                t.close()
