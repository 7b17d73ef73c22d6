"""Tensor and as_tensor: zero-copy views, clear refusals, DLPack, PyTorch."""

from __future__ import annotations

import array

import ml_dtypes
import numpy as np
import pytest

from ferrodist.core import (
    Device,
    InvalidArgument,
    Tensor,
    as_tensor,
    bfloat16,
    device,
    float32,
    host_view,
    reduce_into,
)


def test_numpy_arrays_are_viewed_not_copied():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = as_tensor(a)
    assert t.numpy() is a
    assert (t.shape, t.ndim, t.numel, t.nbytes, t.dtype, str(t.device)) == ((2, 3), 2, 6, 24, float32, "cpu")
    assert np.shares_memory(t.flat(), a) and np.shares_memory(t.bytes_view(), a)
    assert as_tensor(t) is t
    reduce_into(t, np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(a, np.arange(6).reshape(2, 3) + 1)


def test_zero_dim_and_empty_arrays():
    assert as_tensor(np.float64(3.0) * np.ones(())).shape == ()
    assert as_tensor(np.zeros((0, 4), np.int8)).numel == 0


@pytest.mark.parametrize(
    ("make", "dtype_name"),
    [
        (lambda: bytearray(b"\x01\x02\x03"), "uint8"),
        (lambda: array.array("f", [1.0, 2.0]), "float32"),
        (lambda: array.array("q", [1, 2]), "int64"),
        (lambda: memoryview(bytearray(8)).cast("d"), "float64"),
    ],
)
def test_python_buffers_are_viewed_in_place(make, dtype_name):
    buf = make()
    t = as_tensor(buf)
    assert t.dtype.name == dtype_name
    t.numpy()[0] = 7
    assert memoryview(buf)[0] == 7


def test_read_only_buffers_are_marked_read_only():
    t = as_tensor(b"abc")
    assert not t.writeable
    with pytest.raises(InvalidArgument, match="read-only"):
        reduce_into(t, np.zeros(3, np.uint8))


def test_non_contiguous_input_is_refused_not_copied():
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(InvalidArgument, match=r"not C-contiguous.*np.ascontiguousarray"):
        as_tensor(a[:, 1])
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        as_tensor(np.asfortranarray(a))
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        as_tensor(memoryview(bytearray(16))[::2])


@pytest.mark.parametrize("obj", [[1.0, 2.0], (1, 2), 3.5, "text", None, {"a": 1}])
def test_objects_that_cannot_be_viewed_in_place_are_refused(obj):
    with pytest.raises(InvalidArgument, match="cannot view"):
        as_tensor(obj)


def test_unsupported_dtypes_list_the_supported_ones():
    with pytest.raises(InvalidArgument, match=r"complex128.*bfloat16"):
        as_tensor(np.zeros(2, np.complex128))
    with pytest.raises(InvalidArgument, match="not supported"):
        as_tensor(np.zeros(2, ">f4"))


def test_bfloat16_arrays():
    a = np.arange(4).astype(ml_dtypes.bfloat16)
    t = as_tensor(a)
    assert t.dtype is bfloat16 and t.nbytes == 8


def test_dlpack_round_trip_shares_memory():
    a = np.arange(5, dtype=np.int32)
    t = as_tensor(a)
    back = np.from_dlpack(t)
    back[0] = 42
    assert a[0] == 42
    assert t.__dlpack_device__() == (1, 0)
    imported = as_tensor(_DLPackOnly(a))
    assert np.shares_memory(imported.numpy(), a)


def test_bfloat16_dlpack_export_is_refused_clearly():
    with pytest.raises(InvalidArgument, match="DLPack"):
        np.from_dlpack(as_tensor(np.zeros(2, ml_dtypes.bfloat16)))


class _DLPackOnly:
    """An object that only speaks DLPack (like a JAX CPU array)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_devices_parse():
    assert device("cpu") == Device("cpu")
    assert device("cuda:1") == Device("cuda", 1) and str(device("cuda:1")) == "cuda:1"
    assert str(device("cuda")) == "cuda"
    for bad in ["tpu", "cuda:x", "cpu:1", 3]:
        with pytest.raises(InvalidArgument):
            device(bad)


def test_tensor_constructor_rejects_non_arrays():
    with pytest.raises(InvalidArgument, match="as_tensor"):
        Tensor([1, 2])


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize(
    "name", ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool"]
)
def test_every_torch_dtype_is_viewed_without_copy(torch, name):
    t = torch.zeros(3, dtype=getattr(torch, name))
    view = as_tensor(t)
    assert view.dtype.name == name
    view.numpy()[1] = 1
    assert t[1].item() == 1


def test_torch_parameters_with_requires_grad_share_memory(torch):
    p = torch.nn.Parameter(torch.zeros(2))
    as_tensor(p).numpy()[0] = 5
    assert p[0].item() == 5


@pytest.mark.parametrize(
    "name",
    ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool", "complex64"],
)
def test_host_view_of_a_torch_tensor_is_its_memory_and_leaves_its_storage_resizable(torch, name):
    """torch code frees buffers by resizing their storage to zero after a collective (FSDP's
    flat parameters): viewing a tensor must not make that fail, as ``Tensor.numpy()`` would."""
    t = torch.zeros(2, 3, dtype=getattr(torch, name))
    view = host_view(t)
    assert view is not None and view.shape == (2, 3) and view.dtype.name == name
    view[1, 2] = 1
    assert t[1, 2].item() == 1
    if name != "complex64":  # viewed here; ferrodist's collectives move it as float32 pairs
        assert as_tensor(t).numpy()[1, 2] == 1
    t.untyped_storage().resize_(0)  # raised "Trying to resize storage that is not resizable"
    assert t.untyped_storage().nbytes() == 0


def test_host_view_holds_the_tensor_and_refuses_what_has_no_plain_memory(torch):
    view = host_view(torch.full((4,), 3.0)[1:])  # the temporary lives as long as the view
    assert view is not None and list(view) == [3.0, 3.0, 3.0]
    assert host_view(torch.zeros(0)) is not None
    assert host_view(torch.zeros(2, dtype=torch.complex64).conj()) is None  # a conjugate view: as_tensor says why
    assert host_view(torch.zeros(2, dtype=torch.float8_e4m3fn)) is None  # no numpy type
    assert host_view(torch.zeros(2, device="meta")) is None


def test_host_view_reuses_its_array_for_a_tensor_only_while_it_is_the_same_memory(torch):
    """A tensor called on again gets the array made before (no new array per call), unless
    its address, shape or dtype changed in place; what is remembered keeps nothing alive."""
    import gc
    import weakref

    from ferrodist.core import _tensor

    t = torch.arange(6, dtype=torch.float32)
    first, second, third = host_view(t), host_view(t), host_view(t)
    assert first is not second and third is second  # remembered at its second call
    t.resize_(2, 3)  # same memory, another shape
    assert host_view(t).shape == (2, 3)
    t.data = t.data.view(torch.int32)  # same memory and shape, another dtype
    assert host_view(t).dtype == np.int32 and host_view(t).dtype == np.int32
    t.untyped_storage().resize_(0)  # freed in place (FSDP): no memory to view
    assert host_view(t) is None
    u = torch.ones(1 << 16)
    host_view(u), host_view(u)
    storage = weakref.ref(host_view(u).base.owner)
    alive = weakref.ref(u)
    assert id(u) in _tensor._VIEWS
    del u
    gc.collect()
    assert alive() is None and storage() is None  # the tensor and its memory went
    key_gone = all(entry[0]() is not None for entry in _tensor._VIEWS.values())
    assert key_gone  # its entry went with it
    assert host_view(torch.ones(3, 3).to_sparse_csr()) is None  # no strided memory


def test_non_contiguous_torch_tensor_is_refused(torch):
    with pytest.raises(InvalidArgument, match="contiguous"):
        as_tensor(torch.zeros(4, 4).t())


def test_repr_len_and_array_protocol():
    a = np.arange(6, dtype=np.int16).reshape(3, 2)
    t = as_tensor(a)
    assert repr(t) == "Tensor(shape=(3, 2), dtype=int16, device=cpu)"
    assert len(t) == 3
    assert np.asarray(t) is a
    np.testing.assert_array_equal(np.asarray(t, dtype=np.float64), a.astype(np.float64))
    with pytest.raises(TypeError, match="0-d"):
        len(as_tensor(np.zeros(())))
