"""Device tensors in core, under Numba's CUDA simulator (set by tests/conftest.py).

Under the simulator "device memory" is host memory, so zero-copy can be checked by
writing through one view and reading the other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import ferrodist.core as fc
from ferrodist.core import DeviceUnavailable, InvalidArgument

pytestmark = pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="these checks rely on the CUDA simulator's host memory"
)


class _Interface:
    """A foreign CUDA array (as CuPy would be), over host memory the simulator can reach."""

    def __init__(self, host: np.ndarray, strides: tuple[int, ...] | None = None) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": host.shape,
            "typestr": host.dtype.str,
            "data": (host.ctypes.data, False),
            "strides": strides,
            "version": 3,
        }


class _CudaDLPack:
    """A DLPack producer that says its memory is on CUDA device 0 (host memory, simulator)."""

    def __init__(self, array: object) -> None:
        self.array = array

    def __dlpack__(self, stream: object = None) -> object:
        return self.array.__dlpack__()  # type: ignore[attr-defined]

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


@pytest.mark.parametrize("name", [d.name for d in fc.ALL_DTYPES])
def test_to_cuda_and_back_keeps_every_dtype(name: str) -> None:
    dt = fc.dtype(name)
    host = (np.arange(12) % 3).astype(dt.numpy).reshape(3, 4)
    on_device = fc.as_tensor(host).to("cuda")
    assert on_device.is_cuda and str(on_device.device) == "cuda:0"
    assert on_device.dtype is dt and on_device.shape == (3, 4) and on_device.nbytes == host.nbytes
    back = on_device.to("cpu")
    assert not back.is_cuda and back.dtype is dt
    np.testing.assert_array_equal(back.numpy().view(np.uint8), host.view(np.uint8))
    assert on_device.to("cuda") is on_device and on_device.to("cuda:0") is on_device


def test_cuda_array_interface_is_viewed_without_copy() -> None:
    host = np.arange(6, dtype=np.int32)
    t = fc.as_tensor(_Interface(host))
    assert t.is_cuda and t.dtype is fc.int32 and t.data_ptr() == host.ctypes.data
    t.device_array()[2] = 42
    assert host[2] == 42


def test_non_contiguous_cuda_array_is_refused() -> None:
    host = np.zeros((4, 4), np.float32)
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        fc.as_tensor(_Interface(host, strides=(4, 16)))
    # a length-1 dimension's stride does not matter
    ok = np.zeros((1, 4), np.float32)
    assert fc.as_tensor(_Interface(ok, strides=(999, 4))).shape == (1, 4)


def test_numba_device_array_is_accepted_directly() -> None:
    from numba import cuda

    array = cuda.to_device(np.ones(5, np.float64))
    t = fc.as_tensor(array)
    assert t.is_cuda and t.device_array() is array and t.flat().shape == (5,)


def test_cuda_dlpack_is_viewed_without_copy() -> None:
    host = np.arange(8, dtype=np.float32)
    t = fc.as_tensor(_CudaDLPack(host))
    assert t.is_cuda and t.dtype is fc.float32 and t.data_ptr() == host.ctypes.data
    t.device_array()[0] = -1.0
    assert host[0] == -1.0


def test_cuda_dlpack_bfloat16_is_read_as_bfloat16() -> None:
    torch = pytest.importorskip("torch")
    source = torch.arange(4, dtype=torch.bfloat16)
    t = fc.as_tensor(_CudaDLPack(source))
    assert t.dtype is fc.bfloat16 and t.device_array().dtype == np.uint16
    expected = np.arange(4).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(t.to("cpu").numpy(), expected)


def test_device_tensor_refuses_host_only_views() -> None:
    t = fc.as_tensor(np.ones(3, np.float32)).to("cuda")
    with pytest.raises(InvalidArgument, match=r"on cuda:0; copy it to the host with .to\('cpu'\)"):
        t.numpy()
    with pytest.raises(TypeError, match="implicitly"):
        np.asarray(t)
    with pytest.raises(InvalidArgument, match="DLPack"):
        t.__dlpack__()
    assert t.__dlpack_device__() == (2, 0)
    with pytest.raises(InvalidArgument, match="on the CPU"):
        fc.as_tensor(np.ones(2)).device_array()


def test_null_pointer_is_refused() -> None:
    class Null:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}  # noqa: RUF012

    with pytest.raises(InvalidArgument, match="null data pointer"):
        fc.as_tensor(Null())


def test_simulator_has_one_device() -> None:
    t = fc.as_tensor(np.ones(2, np.float32))
    with pytest.raises(InvalidArgument, match="only device 0"):
        t.to("cuda:1")


def test_from_device_array_checks_its_input() -> None:
    from numba import cuda

    with pytest.raises(InvalidArgument, match="Numba device array"):
        fc.Tensor.from_device_array(np.ones(2))
    bits = cuda.to_device(np.zeros(2, np.uint16))
    assert fc.Tensor.from_device_array(bits, dtype="bfloat16").dtype is fc.bfloat16
    with pytest.raises(InvalidArgument, match="cannot be read as float32"):
        fc.Tensor.from_device_array(bits, dtype="float32")
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        fc.Tensor.from_device_array(cuda.to_device(np.ones((3, 4)))[:, ::2])


def test_without_a_gpu_asking_for_cuda_says_what_to_do() -> None:
    """With the simulator off and no GPU, .to("cuda") raises DeviceUnavailable (a subprocess:
    numba decides simulator or not once per process)."""
    code = textwrap.dedent(
        """
        import numpy as np, ferrodist.core as fc

        class Interface:
            __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (8, False), "version": 3}  # noqa: RUF012

        class DLPack:
            def __dlpack__(self, stream=None):
                raise AssertionError("must not be called without a device")

            def __dlpack_device__(self):
                return (2, 0)

        for make in (lambda: fc.as_tensor(np.ones(2)).to("cuda"), lambda: fc.as_tensor(Interface()),
                     lambda: fc.as_tensor(DLPack())):
            try:
                make()
            except fc.DeviceUnavailable as exc:
                print("DeviceUnavailable:", exc)
            else:
                print("GPU present")
        """
    )
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if "GPU present" in out.stdout:
        pytest.skip("this machine has a CUDA GPU")
    assert out.stdout.count("DeviceUnavailable:") == 3, out.stdout
    assert "NUMBA_ENABLE_CUDASIM=1" in out.stdout and "pip install -e ./packages/gpu" in out.stdout
    assert issubclass(DeviceUnavailable, RuntimeError)
