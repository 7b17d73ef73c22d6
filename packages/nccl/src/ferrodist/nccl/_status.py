"""``ncclResult_t`` -> ferrodist errors, in one place (as mpi4py's ``CHKERR``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferrodist.core import (
    CollectiveTimeout,
    DeviceUnavailable,
    FerrodistError,
    InvalidArgument,
)

from ._library import Result

if TYPE_CHECKING:
    from ._library import NcclLibrary

__all__ = ["RESULT_ERRORS", "check", "error_for"]

#: The ferrodist error class raised for each NCCL status.
RESULT_ERRORS: dict[int, type[FerrodistError]] = {
    Result.ncclUnhandledCudaError: DeviceUnavailable,
    Result.ncclSystemError: FerrodistError,
    Result.ncclInternalError: FerrodistError,
    Result.ncclInvalidArgument: InvalidArgument,
    Result.ncclInvalidUsage: InvalidArgument,
    Result.ncclRemoteError: FerrodistError,
    Result.ncclInProgress: FerrodistError,
    Result.ncclTimeout: CollectiveTimeout,
}

_HINTS: dict[int, str] = {
    Result.ncclUnhandledCudaError: (
        "a CUDA call inside NCCL failed: check that a GPU is visible (nvidia-smi, CUDA_VISIBLE_DEVICES) "
        "and that the driver supports the CUDA version of the NCCL wheel; NCCL_DEBUG=INFO shows more"
    ),
    Result.ncclSystemError: (
        "a system call failed (sockets, shared memory, /dev/shm size, open file limits); NCCL_DEBUG=INFO shows which"
    ),
    Result.ncclInternalError: "NCCL hit an internal error; NCCL_DEBUG=INFO shows more",
    Result.ncclInvalidArgument: (
        "check that the buffers are device memory on this communicator's GPU, and the counts, "
        "dtype, op and root agree with the call"
    ),
    Result.ncclInvalidUsage: (
        "the call is not allowed here (a collective inside an unfinished group, a destroyed "
        "communicator, ranks that disagree); NCCL_DEBUG=WARN shows more"
    ),
    Result.ncclRemoteError: (
        "another rank exited or the network between the ranks failed; read that rank's output, "
        "then abort this communicator and create a new one"
    ),
    Result.ncclInProgress: "the operation is still in progress on a non-blocking communicator",
    Result.ncclTimeout: "a peer did not respond in time; check that every rank made the same calls",
}


def error_for(
    status: int,
    operation: str,
    *,
    rank: int | None = None,
    comm: int | None = None,
    library: NcclLibrary | None = None,
) -> FerrodistError:
    """The ferrodist error for a failed NCCL call, with NCCL's own texts in its message."""
    if library is None:
        from ._library import load_library

        library = load_library()
    try:
        name = Result(status).name
    except ValueError:
        name = "unknown ncclResult_t"
    text = library.error_string(status)
    last = library.last_error(comm)
    where = f"rank {rank}: " if rank is not None else ""
    message = f"{where}{operation} failed with NCCL status {int(status)} ({name}: {text})"
    if last:
        message += f"; NCCL's last error: {last}"
    hint = _HINTS.get(status)
    if hint:
        message += f"; {hint}"
    cls = RESULT_ERRORS.get(status, FerrodistError)
    return cls(message, rank=rank, operation=operation)


def check(
    status: int,
    operation: str,
    *,
    rank: int | None = None,
    comm: int | None = None,
    library: NcclLibrary | None = None,
) -> None:
    """Return if ``status`` is ``ncclSuccess``, else raise :func:`error_for` it."""
    if status == Result.ncclSuccess:
        return
    raise error_for(status, operation, rank=rank, comm=comm, library=library)
