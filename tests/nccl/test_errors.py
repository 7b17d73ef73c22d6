"""NCCL and CUDA status codes -> ferrodist errors, with NCCL's own texts in the message."""

from __future__ import annotations

import pytest

from ferrodist.core import (
    CollectiveTimeout,
    DeviceUnavailable,
    FerrodistError,
    InvalidArgument,
)

pytest.importorskip("ferrodist.nccl", reason="ferrodist-nccl is not installed (pip install packages/nccl)")
from ferrodist.nccl import _cuda
from ferrodist.nccl._library import Result
from ferrodist.nccl._status import RESULT_ERRORS, check, error_for

EXPECTED = {
    Result.ncclUnhandledCudaError: DeviceUnavailable,
    Result.ncclSystemError: FerrodistError,
    Result.ncclInternalError: FerrodistError,
    Result.ncclInvalidArgument: InvalidArgument,
    Result.ncclInvalidUsage: InvalidArgument,
    Result.ncclRemoteError: FerrodistError,
    Result.ncclInProgress: FerrodistError,
    Result.ncclTimeout: CollectiveTimeout,
}


def test_every_failure_status_has_an_error_class():
    failures = {r for r in Result if r is not Result.ncclSuccess}
    assert set(RESULT_ERRORS) == failures
    assert all(issubclass(cls, FerrodistError) for cls in RESULT_ERRORS.values())


@pytest.mark.parametrize("status", [r for r in Result if r is not Result.ncclSuccess], ids=lambda r: r.name)
def test_each_status_raises_its_class_with_nccls_text(library, status):
    with pytest.raises(FerrodistError) as info:
        check(status, "all_reduce", rank=3, library=library)
    error = info.value
    assert type(error) is EXPECTED[status]
    message = str(error)
    assert library.error_string(status) in message
    assert "all_reduce" in message and "rank 3" in message and status.name in message
    assert error.rank == 3 and error.operation == "all_reduce"


def test_success_does_not_raise(library):
    check(Result.ncclSuccess, "all_reduce", library=library)


def test_an_unknown_status_is_a_ferrodist_error(library):
    error = error_for(42, "broadcast", library=library)
    assert type(error) is FerrodistError
    assert "42" in str(error) and library.error_string(42) in str(error)


def test_invalid_argument_is_also_a_value_error(library):
    with pytest.raises(ValueError):
        check(Result.ncclInvalidArgument, "send", library=library)


def test_errors_use_the_loaded_library_by_default():
    error = error_for(Result.ncclRemoteError, "recv", rank=1)
    assert "remote process exited" in str(error)


def _cuda_error(name: str):
    rt = _cuda.runtime()
    return getattr(rt.cudaError_t, name)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("cudaErrorNoDevice", DeviceUnavailable),
        ("cudaErrorInsufficientDriver", DeviceUnavailable),
        ("cudaErrorInvalidDevice", DeviceUnavailable),
        ("cudaErrorInvalidValue", InvalidArgument),
        ("cudaErrorIllegalAddress", FerrodistError),
    ],
)
def test_cuda_errors_map_to_ferrodist_errors(name, cls):
    with pytest.raises(FerrodistError) as info:
        _cuda.check_cuda((_cuda_error(name), None), "cudaSomething", rank=2)
    assert type(info.value) is cls
    assert name in str(info.value) and "rank 2" in str(info.value)


def test_cuda_success_returns_the_values():
    ok = _cuda_error("cudaSuccess")
    assert _cuda.check_cuda((ok, 7), "x") == 7
    assert _cuda.check_cuda((ok,), "x") is None
    assert _cuda.check_cuda((ok, 1, 2), "x") == (1, 2)


def test_stream_handles_from_foreign_objects():
    class Torchish:
        cuda_stream = 1234

    class Cupyish:
        ptr = 99

    class Protocol:
        def __cuda_stream__(self):
            return (0, 55)

    assert _cuda.stream_handle(7) == 7
    assert _cuda.stream_handle(Torchish()) == 1234
    assert _cuda.stream_handle(Cupyish()) == 99
    assert _cuda.stream_handle(Protocol()) == 55
    with pytest.raises(InvalidArgument):
        _cuda.stream_handle("stream")
    with pytest.raises(InvalidArgument):
        _cuda.stream_handle(True)
