"""NcclGroup's plans (which NCCL calls each Group method makes), against a recording communicator."""

from __future__ import annotations

import contextlib

import pytest

from ferrodist.core import Group, InvalidArgument, InvalidRank, ReduceOp, Work, dtype

pytest.importorskip("ferrodist.nccl", reason="ferrodist-nccl is not installed (pip install packages/nccl)")
from ferrodist.nccl import NcclGroup
from ferrodist.nccl._buffers import DeviceBuffer, device_buffer

F32 = dtype("float32")


def buf(ptr: int, count: int = 2, dt=F32) -> DeviceBuffer:
    return DeviceBuffer(ptr, count, dt)


class RecordedWork:
    def __init__(self, log, operation):
        self.operation, self._log = operation, log

    def wait(self, timeout=None):
        self._log.append(("wait", self.operation))

    def is_completed(self):
        return True


class RecordingCommunicator:
    """Stands in for NcclCommunicator: records the calls NcclGroup makes."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.device = rank, size, 0
        self.log: list[tuple] = []

    def buffer(self, x, name, operation):
        return device_buffer(x, name=name, operation=operation, rank=self.rank)

    def _record(self, name, *args):
        self.log.append((name, *[a.ptr if isinstance(a, DeviceBuffer) else a for a in args]))

    def all_reduce(self, send, recv=None, op=ReduceOp.SUM):
        self._record("all_reduce", send, recv, op)

    def broadcast(self, send, recv=None, root=0):
        self._record("broadcast", send, recv, root)

    def reduce(self, send, recv=None, root=0, op=ReduceOp.SUM):
        self._record("reduce", send, recv, root, op)

    def all_gather(self, send, recv):
        self._record("all_gather", send, recv)

    def reduce_scatter(self, send, recv, op=ReduceOp.SUM):
        self._record("reduce_scatter", send, recv, op)

    def send(self, x, peer):
        self._record("send", x, peer)

    def recv(self, x, peer):
        self._record("recv", x, peer)

    def copy(self, dst, src):
        self._record("copy", dst, src)

    @contextlib.contextmanager
    def group(self):
        self.log.append(("group_start",))
        yield
        self.log.append(("group_end",))

    def work(self, operation, *, stream=None, timeout=None):
        return RecordedWork(self.log, operation)

    def close(self):
        self.log.append(("close",))

    def abort(self):
        self.log.append(("abort",))


def make(rank=1, size=3):
    comm = RecordingCommunicator(rank, size)
    return NcclGroup(comm), comm.log  # type: ignore[arg-type]


def test_it_satisfies_the_core_group_protocol():
    group, _ = make()
    assert isinstance(group, Group)
    assert (group.rank, group.size) == (1, 3)


def test_blocking_calls_wait_and_async_calls_return_work():
    group, log = make()
    assert group.all_reduce(buf(0x10), ReduceOp.MAX) is None
    assert log == [("all_reduce", 0x10, None, ReduceOp.MAX), ("wait", "all_reduce")]
    work = group.broadcast(buf(0x20), src=2, async_op=True)
    assert isinstance(work, Work)
    assert log[-1] == ("broadcast", 0x20, None, 2)


def test_compress_is_refused_before_any_nccl_call():
    group, log = make()
    with pytest.raises(InvalidArgument, match=r"rank 1: NcclGroup.all_reduce: compress='bf16' is not offered"):
        group.all_reduce(buf(0x10), ReduceOp.SUM, compress="bf16")
    assert log == []


def test_all_gather_into_one_array_is_one_nccl_all_gather():
    group, log = make()
    group.all_gather(buf(0x100, 6), buf(0x10))
    assert log[0] == ("all_gather", 0x10, 0x100)


def test_all_gather_into_a_list_is_grouped_broadcasts():
    group, log = make(rank=1)
    group.all_gather([buf(0x100), buf(0x200), buf(0x300)], buf(0x10))
    assert log[:5] == [
        ("group_start",),
        ("broadcast", 0x100, 0x100, 0),
        ("broadcast", 0x10, 0x200, 1),  # this rank sends its own tensor
        ("broadcast", 0x300, 0x300, 2),
        ("group_end",),
    ]


def test_reduce_scatter_from_a_list_is_grouped_reduces():
    group, log = make(rank=2)
    group.reduce_scatter(buf(0x10), [buf(0x100), buf(0x200), buf(0x300)], "min")
    assert log[1:4] == [
        ("reduce", 0x100, 0x100, 0, "min"),
        ("reduce", 0x200, 0x200, 1, "min"),
        ("reduce", 0x300, 0x10, 2, "min"),
    ]


def test_reduce_scatter_from_one_array():
    group, log = make()
    group.reduce_scatter(buf(0x10), buf(0x100, 6))
    assert log[0][0] == "reduce_scatter" and log[0][2] == 0x10


def test_gather_on_the_root_receives_from_everyone_else():
    group, log = make(rank=0)
    group.gather(buf(0x10), buf(0x100, 6), dst=0)
    assert log[:5] == [("group_start",), ("copy", 0x100, 0x10), ("recv", 0x108, 1), ("recv", 0x110, 2), ("group_end",)]
    group, log = make(rank=2)
    group.gather(buf(0x10), None, dst=0)
    assert log[0] == ("send", 0x10, 0)


def test_scatter_on_the_root_sends_to_everyone_else():
    group, log = make(rank=1)
    group.scatter(buf(0x10), [buf(0x100), buf(0x200), buf(0x300)], src=1)
    assert log[1:4] == [("send", 0x100, 0), ("copy", 0x10, 0x200), ("send", 0x300, 2)]
    group, log = make(rank=0)
    group.scatter(buf(0x10), None, src=1)
    assert log[0] == ("recv", 0x10, 1)


def test_all_to_all_pairs_every_send_with_a_receive():
    group, log = make(rank=1)
    group.all_to_all(buf(0x100, 6), [buf(0x10), buf(0x20), buf(0x30)])
    assert log[:7] == [
        ("group_start",),
        ("send", 0x10, 0),
        ("recv", 0x100, 0),
        ("copy", 0x108, 0x20),
        ("send", 0x30, 2),
        ("recv", 0x110, 2),
        ("group_end",),
    ]


def test_all_to_all_refuses_mixed_dtypes_and_uneven_splits():
    group, _ = make()
    with pytest.raises(InvalidArgument, match="mix dtypes"):
        group.all_to_all([buf(1), buf(2), buf(3, dt=dtype("int32"))], [buf(4), buf(5), buf(6)])
    with pytest.raises(InvalidArgument, match="multiple of 3"):
        group.all_to_all(buf(1, 4), buf(2, 6))


def test_bad_roots_and_peers_are_invalid_ranks():
    group, log = make(rank=1)
    with pytest.raises(InvalidRank, match="dst 3"):
        group.gather(buf(1), None, dst=3)
    with pytest.raises(InvalidRank, match="itself"):
        group.send(buf(1), 1)
    with pytest.raises(InvalidRank):
        group.irecv(buf(1), -1)
    with pytest.raises(InvalidArgument, match="tag"):
        group.isend(buf(1), 0, tag=-2)
    with pytest.raises(InvalidArgument, match="NCCL receives from one named rank; pass src="):
        group.recv(buf(1), None)
    assert log == []


def test_gather_root_needs_a_list_and_blocks_must_match():
    group, _ = make(rank=0)
    with pytest.raises(InvalidArgument, match="gather_list"):
        group.gather(buf(1), None, dst=0)
    with pytest.raises(InvalidArgument, match="expected 3 x 2"):
        group.gather(buf(1), buf(2, 5), dst=0)
    with pytest.raises(InvalidArgument, match="int32"):
        group.gather(buf(1), [buf(2), buf(3, dt=dtype("int32")), buf(4)], dst=0)


def test_point_to_point_ignores_tags_and_waits_when_blocking():
    group, log = make(rank=0)
    group.send(buf(0x10), 2, tag=7)
    assert log == [("send", 0x10, 2), ("wait", "send")]
    work = group.irecv(buf(0x20), 1)
    assert work.operation == "irecv"
    assert group.recv(buf(0x30), 2) == 2  # the sender, as every group's recv returns it


def test_close_closes_the_communicator_and_errors_abort_it():
    group, log = make()
    with group:
        pass
    assert log[-1] == ("close",)
    group, log = make()
    with pytest.raises(RuntimeError), group:
        raise RuntimeError("boom")
    assert log[-1] == ("abort",)
