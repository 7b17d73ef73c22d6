"""Raw asynchronous copies between device memory and pinned host memory, on streams of
their own, through the CUDA driver API (cuda-python's ``cuda.bindings.driver``).

The staging engine moves bytes by address: it works out a tensor's device address once
per call and adds offsets, so a call makes no Numba device-array views and few driver
calls (a copy, an event record, an event query per segment and direction). Each thread
that runs staged calls has its own :class:`Copies`: a *down* stream (device -> host), an
*up* stream (host -> device) and one event per host buffer and direction.

Both streams are created as blocking streams: they wait for work issued before on the
legacy default stream (where PyTorch, CuPy and Numba put work unless told otherwise),
and work issued on it later waits for them. Work on other streams must be synchronised
by its owner before a collective reads the tensor.

Under Numba's CUDA simulator "device memory" is host memory, and
``ferrodist.core.cuda.SIMULATED`` stands in for the driver: the same calls, done at once
with ``memmove``. Tests can hand :class:`Copies` any object with the driver's functions
(see ``tests/gpu``). Every call needs a context current in the calling thread: the engine
makes one current (``ferrodist.core.cuda.on_device``) before it stages.
"""

from __future__ import annotations

import time
from typing import Any

from ferrodist.core import CollectiveTimeout, FerrodistError
from ferrodist.core import cuda as core_cuda

__all__ = ["Copies"]

#: How long a wait for a copy spins on ``cuEventQuery`` before it sleeps between queries.
SPIN_SECONDS = 200e-6
_NAP = 20e-6


class Copies:
    """One thread's streams and events for staging ``slots`` host buffers each way.

    Args:
        cu: the driver (``driver()``, or :data:`SIMULATED`).
        slots: host buffers the caller rotates through; each has a *down* and an *up* event.
    """

    def __init__(self, cu: Any, slots: int) -> None:
        self.driver = cu
        self._cu = cu
        self._not_ready = int(cu.CUresult.CUDA_ERROR_NOT_READY)
        stream_flags = cu.CUstream_flags.CU_STREAM_DEFAULT
        event_flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._down = self._check(cu.cuStreamCreate(stream_flags), "cuStreamCreate")
        self._up = self._check(cu.cuStreamCreate(stream_flags), "cuStreamCreate")
        self._downed = [self._check(cu.cuEventCreate(event_flags), "cuEventCreate") for _ in range(slots)]
        self._upped = [self._check(cu.cuEventCreate(event_flags), "cuEventCreate") for _ in range(slots)]

    def _check(self, result: Any, what: str) -> Any:
        return core_cuda.check(result, what, cu=self._cu)

    def _error(self, err: Any, what: str) -> FerrodistError:
        return core_cuda.error(err, what, cu=self._cu)

    # -- enqueue -----------------------------------------------------------------------------
    def down(self, host: int, device: int, nbytes: int) -> None:
        """Queue a copy of ``nbytes`` from device address ``device`` to host address ``host``."""
        if nbytes:
            err = self._cu.cuMemcpyDtoHAsync(host, device, nbytes, self._down)[0]
            if err:
                raise self._error(err, f"cuMemcpyDtoHAsync of {nbytes} bytes")

    def up(self, device: int, host: int, nbytes: int) -> None:
        """Queue a copy of ``nbytes`` from host address ``host`` to device address ``device``."""
        if nbytes:
            err = self._cu.cuMemcpyHtoDAsync(device, host, nbytes, self._up)[0]
            if err:
                raise self._error(err, f"cuMemcpyHtoDAsync of {nbytes} bytes")

    def downed(self, slot: int) -> None:
        """Mark the copies queued so far on the down stream as buffer ``slot``'s."""
        err = self._cu.cuEventRecord(self._downed[slot], self._down)[0]
        if err:
            raise self._error(err, "cuEventRecord")

    def upped(self, slot: int) -> None:
        """Mark the copies queued so far on the up stream as buffer ``slot``'s."""
        err = self._cu.cuEventRecord(self._upped[slot], self._up)[0]
        if err:
            raise self._error(err, "cuEventRecord")

    def down_after_up(self, slot: int) -> None:
        """Make later down copies wait until buffer ``slot``'s up copies are done (the
        buffer is about to be refilled)."""
        err = self._cu.cuStreamWaitEvent(self._down, self._upped[slot], 0)[0]
        if err:
            raise self._error(err, "cuStreamWaitEvent")

    # -- wait --------------------------------------------------------------------------------
    def wait_down(self, slot: int, deadline: float, rank: int) -> None:
        """Return once buffer ``slot``'s down copies are done (its bytes are on the host)."""
        self._wait(self._downed[slot], deadline, rank, "device to host")

    def wait_up(self, slot: int, deadline: float, rank: int) -> None:
        """Return once buffer ``slot``'s up copies are done (the buffer may be reused)."""
        self._wait(self._upped[slot], deadline, rank, "host to device")

    def _wait(self, event: Any, deadline: float, rank: int, what: str) -> None:
        query = self._cu.cuEventQuery
        err = query(event)[0]
        if not err:
            return
        spin_until = time.monotonic() + SPIN_SECONDS
        while True:
            if int(err) != self._not_ready:
                raise self._error(err, f"a copy {what}")
            now = time.monotonic()
            if now >= deadline:
                raise CollectiveTimeout(
                    f"rank {rank}: a copy {what} did not finish before the call's deadline; "
                    "the GPU is stalled or busy with other work (see nvidia-smi)",
                    rank=rank,
                )
            if now >= spin_until:
                time.sleep(_NAP)
            err = query(event)[0]
            if not err:
                return
