"""The communicator without a GPU: clear errors, never a crash or a hang; its waiting logic
(timeouts, asynchronous errors, non-blocking progress) against a scripted NCCL."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time

import pytest

from ferrodist.core import (
    CollectiveTimeout,
    DeviceUnavailable,
    FerrodistError,
    InvalidArgument,
    InvalidRank,
)

pytest.importorskip("ferrodist.nccl", reason="ferrodist-nccl is not installed (pip install packages/nccl)")
from ferrodist.nccl import NcclCommunicator, NcclConfig, get_unique_id
from ferrodist.nccl import _communicator as communicator_module
from ferrodist.nccl._library import CONFIG_UNDEF_INT, Result


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_creation_without_a_gpu_is_device_unavailable_in_a_fresh_process(no_gpu):
    code = (
        "import time\n"
        "from ferrodist.core import DeviceUnavailable\n"
        "from ferrodist.nccl import NcclCommunicator, get_unique_id\n"
        "start = time.monotonic()\n"
        "try:\n"
        "    NcclCommunicator(0, 1, get_unique_id(), timeout=20)\n"
        "except DeviceUnavailable as exc:\n"
        "    print('DeviceUnavailable', round(time.monotonic() - start, 3), exc)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("DeviceUnavailable"), result.stdout + result.stderr
    seconds = float(result.stdout.split()[1])
    assert seconds < 10
    assert "rank 0" in result.stdout and "GPU" in result.stdout


def test_creation_without_a_gpu_in_process(no_gpu):
    start = time.monotonic()
    with pytest.raises(DeviceUnavailable, match="NcclCommunicator") as info:
        NcclCommunicator(0, 1, get_unique_id())
    assert time.monotonic() - start < 10
    assert info.value.rank == 0


def test_nccls_own_init_failure_without_a_gpu_maps_to_device_unavailable(no_gpu):
    code = (
        "import ctypes\n"
        "from ferrodist.nccl._library import load_library, UniqueIdStruct\n"
        "from ferrodist.nccl._ids import get_unique_id\n"
        "from ferrodist.nccl._status import error_for\n"
        "lib = load_library()\n"
        "uid = UniqueIdStruct.from_buffer_copy(get_unique_id(lib))\n"
        "comm = ctypes.c_void_p()\n"
        "status = lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0)\n"
        "error = error_for(status, 'ncclCommInitRank', rank=0, library=lib)\n"
        "print(status, type(error).__name__, error)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    status, name, message = result.stdout.split(" ", 2)
    assert int(status) == Result.ncclUnhandledCudaError
    assert name == "DeviceUnavailable"
    assert "unhandled cuda error" in message and "Cuda failure" in message


@pytest.mark.parametrize(
    ("rank", "size", "uid", "error", "match"),
    [
        (0, 0, b"x" * 128, InvalidArgument, "size"),
        (2, 2, b"x" * 128, InvalidRank, "outside 0..1"),
        (-1, 2, b"x" * 128, InvalidRank, "outside"),
        (0, 1, b"short", InvalidArgument, "128 bytes"),
        (0, 1, 128, InvalidArgument, "128 bytes"),
        (0, 1, bytes(128), InvalidArgument, "128 bytes"),
    ],
)
def test_arguments_are_checked_before_any_device_call(rank, size, uid, error, match):
    with pytest.raises(error, match=match):
        NcclCommunicator(rank, size, uid)


def test_timeouts_must_be_positive():
    with pytest.raises(InvalidArgument, match="timeout"):
        NcclCommunicator(0, 1, b"x" * 128, timeout=0)


def test_from_group_without_gpus_fails_on_every_rank_at_once(no_gpu):
    from ferrodist.collectives import new_group
    from ferrodist.testing import run_world

    def rank_main() -> None:
        NcclCommunicator.from_group(new_group([0, 1]), timeout=20)

    start = time.monotonic()
    with pytest.raises(DeviceUnavailable):
        run_world(2, rank_main, timeout=20, run_timeout=60)
    assert time.monotonic() - start < 20


def test_config_struct_sets_only_what_is_asked():
    config = NcclConfig(max_ctas=8, comm_name="trainer").to_struct()
    assert config.blocking == 0
    assert config.maxCTAs == 8
    assert config.minCTAs == CONFIG_UNDEF_INT
    assert config.commName == b"trainer"
    assert config.netName is None
    assert NcclConfig(blocking=True).to_struct().blocking == 1
    with pytest.raises(InvalidArgument, match="minCTAs"):
        NcclConfig(min_ctas=-1).to_struct()


# -- the waiting logic, against a scripted NCCL ------------------------------------------------


class ScriptedNccl:
    """Answers ncclCommGetAsyncError from a script; records aborts. Texts come from the real library."""

    def __init__(self, real, states):
        self._real = real
        self.states = list(states)
        self.aborted = 0

    def has(self, name):
        return True

    def ncclCommGetAsyncError(self, comm, state_ref):
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        ctypes.cast(state_ref, ctypes.POINTER(ctypes.c_int))[0] = state
        return Result.ncclSuccess

    def ncclCommAbort(self, comm):
        self.aborted += 1
        return Result.ncclSuccess

    def error_string(self, status):
        return self._real.error_string(status)

    def last_error(self, comm=None):
        return ""


@pytest.fixture
def scripted(monkeypatch, library):
    """A communicator object wired to a ScriptedNccl, with no CUDA underneath."""
    monkeypatch.setattr(communicator_module._cuda, "destroy_stream", lambda stream: None)

    def make(states, timeout=5.0):
        comm = NcclCommunicator.__new__(NcclCommunicator)
        comm._rank, comm._size, comm._device, comm._timeout = 1, 4, 0, timeout
        comm._comm, comm._stream, comm._closed = 0x1234, 0x5678, False
        comm._config = NcclConfig()
        comm._lib = ScriptedNccl(library, states)
        return comm

    return make


def test_a_wait_past_its_timeout_aborts_and_raises(scripted):
    comm = scripted([Result.ncclSuccess])
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"all_reduce did not finish within 0\.2s") as info:
        comm.wait_until(lambda: False, "all_reduce", timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 3
    assert comm._lib.aborted == 1 and comm.closed
    assert info.value.rank == 1
    with pytest.raises(FerrodistError, match="closed"):
        comm.synchronize()


def test_an_asynchronous_error_aborts_and_raises_nccls_text(scripted):
    comm = scripted([Result.ncclSuccess, Result.ncclRemoteError])
    with pytest.raises(FerrodistError, match="remote process exited") as info:
        comm.wait_until(lambda: False, "broadcast", timeout=5)
    assert "aborted" in str(info.value) and "rank 1" in str(info.value)
    assert comm._lib.aborted == 1 and comm.closed


def test_a_wait_returns_when_done(scripted):
    comm = scripted([Result.ncclSuccess])
    polls = iter([False, False, True])
    comm.wait_until(lambda: next(polls), "all_gather", timeout=5)
    assert not comm.closed


def test_in_progress_is_polled_until_it_settles(scripted):
    comm = scripted([Result.ncclInProgress, Result.ncclInProgress, Result.ncclSuccess])
    comm._settle(Result.ncclInProgress, "ncclCommInitRank", time.monotonic() + 5, timeout=5)
    assert not comm.closed


def test_in_progress_that_never_settles_times_out(scripted):
    comm = scripted([Result.ncclInProgress])
    with pytest.raises(CollectiveTimeout, match="ncclCommInitRank"):
        comm._settle(Result.ncclInProgress, "ncclCommInitRank", time.monotonic() + 0.1, timeout=0.1)
    assert comm._lib.aborted == 1


def test_in_progress_that_settles_on_an_error_raises_it(scripted):
    comm = scripted([Result.ncclInProgress, Result.ncclInvalidUsage])
    with pytest.raises(InvalidArgument, match="invalid usage"):
        comm._settle(Result.ncclInProgress, "ncclGroupEnd", time.monotonic() + 5, timeout=5)


def test_abort_and_close_are_idempotent(scripted):
    comm = scripted([Result.ncclSuccess])
    comm.abort()
    comm.abort()
    comm.close()
    assert comm._lib.aborted == 1
    assert "closed" in repr(comm)
