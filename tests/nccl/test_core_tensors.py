"""Core's CUDA tensors (here: under Numba's CUDA simulator) become NCCL buffers through
``as_tensor`` and ``Tensor.data_ptr()``."""

from __future__ import annotations

import numpy as np
import pytest

from ferrodist.core import InvalidArgument, as_tensor

pytest.importorskip("ferrodist.nccl", reason="ferrodist-nccl is not installed (pip install packages/nccl)")
from ferrodist.nccl._buffers import blocks, device_buffer


@pytest.fixture
def simulated_cuda():
    from numba import config

    if not config.ENABLE_CUDASIM:
        pytest.skip("runs under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set by tests/conftest.py)")
    from numba import cuda

    return cuda


def test_a_core_cuda_tensor_gives_its_data_ptr(simulated_cuda):
    array = simulated_cuda.to_device(np.arange(6, dtype=np.float32))
    tensor = as_tensor(array)
    assert tensor.device.type == "cuda"
    for source in (array, tensor):
        buf = device_buffer(source, name="x", operation="all_reduce")
        assert (buf.ptr, buf.count, buf.dtype.name) == (tensor.data_ptr(), 6, "float32")


def test_a_core_cuda_tensor_cut_into_blocks(simulated_cuda):
    tensor = as_tensor(simulated_cuda.to_device(np.zeros(8, dtype=np.int64)))
    parts = blocks(tensor, 4, 2, name="output", operation="all_gather")
    assert [p.ptr - tensor.data_ptr() for p in parts] == [0, 32]


def test_a_cpu_tensor_is_refused(simulated_cuda):
    with pytest.raises(InvalidArgument, match="GPU memory only"):
        device_buffer(as_tensor(np.zeros(2)), name="x", operation="broadcast")
