"""NCCL on real GPUs: skipped (with the reason) where ``cudaGetDeviceCount`` fails or says 0.

Run on a GPU machine with ``NUMBA_ENABLE_CUDASIM=0 .venv/bin/python -m pytest -q tests/nccl -m gpu``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ferrodist.core import CollectiveTimeout, InvalidArgument, ReduceOp, dtype

pytest.importorskip("ferrodist.nccl", reason="ferrodist-nccl is not installed (pip install packages/nccl)")
from ferrodist.nccl import NcclCommunicator, NcclGroup, _cuda, get_unique_id
from ferrodist.nccl._buffers import DeviceBuffer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


class DeviceArray:
    """``cudaMalloc``'d memory holding a copy of a host array (freed by ``free``)."""

    def __init__(self, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        self.shape, self.dtype = host.shape, host.dtype
        self.ptr = _cuda.malloc(host.nbytes)
        _cuda.memcpy_htod(self.ptr, host)
        self.buffer = DeviceBuffer(self.ptr, host.size, dtype(host.dtype))
        self.__cuda_array_interface__ = {
            "shape": host.shape,
            "typestr": host.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
        }

    def get(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        _cuda.memcpy_dtoh(out, self.ptr)
        return out

    def free(self) -> None:
        _cuda.free(self.ptr)


@pytest.fixture
def comm(gpu):
    _cuda.set_device(0)
    with NcclCommunicator(0, 1, get_unique_id(), device=0, timeout=60) as communicator:
        yield communicator


@pytest.fixture
def arrays(gpu):
    made: list[DeviceArray] = []

    def make(host):
        made.append(DeviceArray(np.asarray(host)))
        return made[-1]

    yield make
    for array in made:
        array.free()


def test_one_rank_all_reduce(comm, arrays):
    x = arrays(np.arange(8, dtype=np.float32))
    comm.all_reduce(x.buffer, op=ReduceOp.SUM)
    comm.synchronize()
    np.testing.assert_array_equal(x.get(), np.arange(8, dtype=np.float32))
    assert (comm.rank, comm.size, comm.device) == (0, 1, 0)


def test_one_rank_out_of_place_broadcast_all_gather_reduce_scatter(comm, arrays):
    src = arrays(np.array([1, 2, 3, 4], dtype=np.int64))
    out = arrays(np.zeros(4, dtype=np.int64))
    comm.broadcast(src.buffer, out.buffer, root=0)
    comm.all_gather(src.buffer, out.buffer)
    comm.reduce_scatter(src.buffer, out.buffer, op="max")
    comm.synchronize()
    np.testing.assert_array_equal(out.get(), [1, 2, 3, 4])


def test_one_rank_group_api(comm, arrays):
    group = NcclGroup(comm)
    x = arrays(np.full(5, 2.0, dtype=np.float64))
    out = arrays(np.zeros(5, dtype=np.float64))
    group.all_reduce(x.buffer, ReduceOp.AVG)
    group.broadcast(x.buffer, src=0)
    group.all_gather([out.buffer], x.buffer)
    work = group.reduce_scatter(out.buffer, [x.buffer], async_op=True)
    assert work is not None
    work.wait()
    assert work.is_completed()
    group.barrier(timeout=30)
    group.all_to_all([out.buffer], [x.buffer])
    np.testing.assert_array_equal(out.get(), np.full(5, 2.0))
    group.close()


def test_a_cuda_array_interface_object_is_accepted(comm, arrays):
    from numba import config

    if config.ENABLE_CUDASIM:
        pytest.skip("run with NUMBA_ENABLE_CUDASIM=0 to pass real CUDA arrays through core's as_tensor")
    x = arrays(np.ones(3, dtype=np.float32))
    comm.all_reduce(x)
    comm.synchronize()
    np.testing.assert_array_equal(x.get(), np.ones(3))


def test_host_memory_is_refused(comm):
    host = np.zeros(4, dtype=np.float32)
    with pytest.raises(InvalidArgument, match="host memory"):
        comm.all_reduce(DeviceBuffer(host.ctypes.data, 4, dtype("float32")))


def test_mismatched_sizes_are_refused(comm, arrays):
    a, b = arrays(np.zeros(4, np.float32)), arrays(np.zeros(3, np.float32))
    with pytest.raises(InvalidArgument, match="expected 4"):
        comm.all_reduce(a.buffer, b.buffer)


def test_a_missing_peer_times_out_instead_of_hanging(gpu):
    _cuda.set_device(0)
    with pytest.raises(CollectiveTimeout):
        NcclCommunicator(0, 2, get_unique_id(), device=0, timeout=5)  # rank 1 never comes


_RANK_MAIN = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from ferrodist.core import dtype
    from ferrodist.nccl import NcclCommunicator, NcclGroup, _cuda
    from ferrodist.nccl._buffers import DeviceBuffer
    rank, uid = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
    _cuda.set_device(rank)
    def device(host):
        ptr = _cuda.malloc(host.nbytes)
        _cuda.memcpy_htod(ptr, host)
        return ptr, DeviceBuffer(ptr, host.size, dtype(host.dtype))
    def fetch(ptr, n):
        out = np.empty(n, np.float32)
        _cuda.memcpy_dtoh(out, ptr)
        return out.tolist()
    group = NcclGroup(NcclCommunicator(rank, 2, uid, device=rank, timeout=60))
    x_ptr, x = device(np.full(4, rank + 1.0, np.float32))
    group.all_reduce(x)
    g_ptr, g = device(np.zeros(8, np.float32))
    group.all_gather(g, x)
    r_ptr, r = device(np.zeros(2, np.float32))
    group.reduce_scatter(r, DeviceBuffer(g_ptr, 4, dtype("float32")))
    p_ptr, p = device(np.full(3, 10.0 * rank, np.float32))
    if rank == 0:
        group.send(p, 1)
    else:
        group.recv(p, 0)
    group.barrier()
    print(json.dumps({"all_reduce": fetch(x_ptr, 4), "all_gather": fetch(g_ptr, 8),
                      "reduce_scatter": fetch(r_ptr, 2), "p2p": fetch(p_ptr, 3)}))
    group.close()
    """
)


def test_two_ranks_in_two_processes(two_gpus):
    uid = get_unique_id().hex()
    env_code = ["-c", _RANK_MAIN]
    ranks = [
        subprocess.Popen(
            [sys.executable, *env_code, str(r), uid], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    results = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=100)
            assert process.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    for rank, result in enumerate(results):
        assert result["all_reduce"] == [3.0] * 4
        assert result["all_gather"] == [3.0] * 8
        assert result["reduce_scatter"] == [6.0, 6.0]
        assert result["p2p"] == [0.0] * 3, rank
