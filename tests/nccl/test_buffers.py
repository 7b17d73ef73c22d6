"""Device buffers, dtypes and reduce ops as NCCL needs them (no GPU: fake CUDA arrays)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import examples
from ferrodist.core import ALL_DTYPES, DeviceUnavailable, InvalidArgument, ReduceOp, as_tensor, dtype

pytest.importorskip("ferrodist.nccl", reason="ferrodist-nccl is not installed (pip install packages/nccl)")
from ferrodist.nccl import _buffers
from ferrodist.nccl._buffers import DeviceBuffer, _device_pointer, blocks, device_buffer, nccl_datatype, nccl_op
from ferrodist.nccl._library import DataType, RedOp


@pytest.fixture(autouse=True)
def _without_numba_cuda(monkeypatch):
    """Core's ``as_tensor`` as it behaves where numba.cuda cannot run: CUDA arrays raise
    ``DeviceUnavailable`` (so the fake arrays below never reach Numba or its simulator)."""

    def without_cuda(obj):
        if hasattr(obj, "__cuda_array_interface__"):
            raise DeviceUnavailable("numba.cuda is not usable in this test")
        return as_tensor(obj)

    monkeypatch.setattr(_buffers, "as_tensor", without_cuda)


class FakeCudaArray:
    """Something exporting ``__cuda_array_interface__`` (as Numba / CuPy device arrays do)."""

    def __init__(self, shape, typestr="<f4", ptr=0x7000_0000, strides=None):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }


class FakeDeviceTensor:
    """What core's CUDA Tensor will look like: ``device.type == 'cuda'`` and ``data_ptr()``."""

    def data_ptr(self):
        return 0xABC000


def test_device_pointer_prefers_data_ptr_then_the_interface():
    assert _device_pointer(FakeDeviceTensor()) == 0xABC000
    assert _device_pointer(FakeCudaArray((4,), ptr=0x1234)) == 0x1234

    with pytest.raises(InvalidArgument):
        _device_pointer(object())


def test_a_cuda_array_becomes_a_buffer_without_copy():
    buf = device_buffer(FakeCudaArray((2, 3), "<f8", ptr=0x1000), name="x", operation="all_reduce")
    assert buf == DeviceBuffer(0x1000, 6, dtype("float64"))
    assert buf.nbytes == 48
    assert buf.block(1, 2) == DeviceBuffer(0x1000 + 16, 2, dtype("float64"))


@settings(max_examples=examples(50))
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    dt=st.sampled_from([d for d in ALL_DTYPES if d.name != "bfloat16"]),
    ptr=st.integers(1, 2**48),
)
def test_buffers_keep_pointer_count_and_dtype(shape, dt, ptr):
    buf = device_buffer(FakeCudaArray(shape, dt.numpy.str, ptr=ptr), name="x", operation="op")
    assert (buf.ptr, buf.count, buf.dtype) == (ptr, int(np.prod(shape, dtype=np.int64)), dt)


def test_contiguous_strides_are_accepted_and_others_refused():
    ok = FakeCudaArray((2, 3), "<f4", strides=(12, 4))
    assert device_buffer(ok, name="x", operation="op").count == 6
    transposed = FakeCudaArray((3, 2), "<f4", strides=(4, 12))
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        device_buffer(transposed, name="x", operation="all_reduce", rank=1)


def test_host_arrays_are_refused_with_advice():
    with pytest.raises(InvalidArgument, match="GPU memory only") as info:
        device_buffer(np.zeros(3, np.float32), name="tensor", operation="all_reduce", rank=0)
    assert "rank 0" in str(info.value) and "ProcessGroup" in str(info.value)


def test_unsupported_element_types_are_refused():
    with pytest.raises(InvalidArgument):
        device_buffer(FakeCudaArray((2,), "<c8"), name="x", operation="op")


def test_null_pointer_with_elements_is_refused():
    with pytest.raises(InvalidArgument, match="NULL"):
        device_buffer(FakeCudaArray((2,), ptr=0), name="x", operation="op")
    assert device_buffer(FakeCudaArray((0,), ptr=0), name="x", operation="op").count == 0


def test_blocks_from_a_list_or_one_array():
    parts = blocks([FakeCudaArray((2,), ptr=0x100 * (i + 1)) for i in range(3)], 2, 3, name="out", operation="op")
    assert [p.ptr for p in parts] == [0x100, 0x200, 0x300]
    whole = blocks(FakeCudaArray((6,), ptr=0x1000), 2, 3, name="out", operation="op")
    assert [p.ptr for p in whole] == [0x1000, 0x1008, 0x1010]
    with pytest.raises(InvalidArgument, match="2 entries"):
        blocks([FakeCudaArray((2,))] * 2, 2, 3, name="out", operation="op")
    with pytest.raises(InvalidArgument, match=r"expected 3 x 2"):
        blocks(FakeCudaArray((5,)), 2, 3, name="out", operation="op")
    with pytest.raises(InvalidArgument, match=r"out\[1\] has 3"):
        blocks([FakeCudaArray((2,)), FakeCudaArray((3,)), FakeCudaArray((2,))], 2, 3, name="out", operation="op")


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=lambda d: d.name)
def test_datatypes_follow_the_core_table(dt):
    if dt.nccl is None:
        with pytest.raises(InvalidArgument, match=dt.name) as info:
            nccl_datatype(dt, operation="all_reduce", rank=0)
        assert "int32" in str(info.value)
    else:
        assert nccl_datatype(dt, operation="all_reduce") == dt.nccl
        assert dt.nccl in {d.value for d in DataType}


def test_reduce_ops_map_to_nccl():
    f32 = dtype("float32")
    assert nccl_op(ReduceOp.SUM, f32, operation="x") == RedOp.ncclSum
    assert nccl_op(ReduceOp.PRODUCT, f32, operation="x") == RedOp.ncclProd
    assert nccl_op(ReduceOp.MIN, f32, operation="x") == RedOp.ncclMin
    assert nccl_op(ReduceOp.MAX, f32, operation="x") == RedOp.ncclMax
    assert nccl_op(ReduceOp.AVG, f32, operation="x") == RedOp.ncclAvg
    assert nccl_op("max", f32, operation="x") == RedOp.ncclMax


def test_bool_reductions_are_logical():
    b = dtype("bool")
    assert nccl_op(ReduceOp.SUM, b, operation="x") == RedOp.ncclMax
    assert nccl_op(ReduceOp.PRODUCT, b, operation="x") == RedOp.ncclMin


@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
def test_bitwise_ops_are_refused(op):
    with pytest.raises(InvalidArgument, match=f"no {op.name} reduction") as info:
        nccl_op(op, dtype("int32"), operation="all_reduce", rank=2)
    assert "rank 2" in str(info.value)


def test_avg_on_integers_is_refused_by_the_core_table():
    with pytest.raises(InvalidArgument, match="AVG"):
        nccl_op(ReduceOp.AVG, dtype("int64"), operation="all_reduce")


def test_unknown_op_names_are_refused():
    with pytest.raises(InvalidArgument):
        nccl_op("median", dtype("float32"), operation="all_reduce")


def test_a_buffer_of_a_tensor_knows_its_gpu_and_the_communicator_asks_cuda_only_for_bare_pointers(monkeypatch):
    from ferrodist.core import Tensor
    from ferrodist.nccl import _communicator

    asked: list[int] = []

    def pointer_device(pointer: int) -> int:
        asked.append(pointer)
        return 0

    monkeypatch.setattr(_communicator._cuda, "pointer_device", pointer_device)
    comm = _communicator.NcclCommunicator.__new__(_communicator.NcclCommunicator)
    comm._rank, comm._device = 0, 0
    known = DeviceBuffer(4096, 4, dtype("float32"), 0)
    assert comm.buffer(known, "tensor", "all_reduce") is known and asked == []  # the group's Tensor is trusted
    assert known.block(1, 2).device == 0
    with pytest.raises(
        InvalidArgument, match=r"rank 0: all_reduce: tensor is on cuda:1, but this communicator runs on cuda:0"
    ):
        comm.buffer(DeviceBuffer(4096, 4, dtype("float32"), 1), "tensor", "all_reduce")
    assert asked == []
    assert comm.buffer(DeviceBuffer(8192, 4, dtype("float32")), "tensor", "all_reduce").ptr == 8192
    assert asked == [8192]  # a bare pointer: CUDA says where it is
    cuda = pytest.importorskip("numba.cuda")
    tensor = Tensor.from_device_array(cuda.to_device(np.ones(4, np.float32)))
    assert device_buffer(tensor, name="tensor", operation="all_reduce").device == tensor.device.index
