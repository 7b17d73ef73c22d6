"""The CUDA driver calls ferrodist makes, for Numba's CUDA simulator (private).

Under ``NUMBA_ENABLE_CUDASIM=1`` "device memory" is host memory, so a copy is a
``memmove`` done when it is issued and every event is complete at once. What the
simulator keeps from a real driver is the rule that bit ferrodist on hardware: a call
that needs a context fails with ``CUDA_ERROR_INVALID_CONTEXT`` in a thread that has not
made one current (``cuCtxSetCurrent`` / ``cuCtxPushCurrent``, which
:func:`ferrodist.core.cuda.on_device` does). A code path that forgets to make the context
current in a new thread (a rank of ``run_world``, a group's async worker, a DDP hook
running in an autograd thread) therefore fails on the simulator as it would on a GPU.

Tests subclass :class:`SimulatedDriver` to defer copies or stall them (``tests/gpu``).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from types import SimpleNamespace
from typing import Any

__all__ = ["INVALID_CONTEXT", "NOT_READY", "SimulatedDriver"]

#: Status codes as the CUDA driver numbers them.
NOT_READY = 600
INVALID_CONTEXT = 201
_NAMES = {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", INVALID_CONTEXT: "CUDA_ERROR_INVALID_CONTEXT"}
_NAMES[NOT_READY] = "CUDA_ERROR_NOT_READY"
_CONTEXT_BASE = 0xC0_0000  # a primary context's stand-in handle is this plus the device ordinal


class SimulatedDriver:
    """cuda-python's driver functions that ferrodist calls, over host memory.

    Results are tuples ``(status, value...)`` as cuda-python returns them, with plain
    ints for statuses and handles. Each thread has its own current context (none at
    first); every call below the context section needs one.
    """

    CUresult = SimpleNamespace(
        CUDA_SUCCESS=0, CUDA_ERROR_NOT_READY=NOT_READY, CUDA_ERROR_INVALID_CONTEXT=INVALID_CONTEXT
    )
    CUstream_flags = SimpleNamespace(CU_STREAM_DEFAULT=0)
    CUevent_flags = SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
    CUpointer_attribute = SimpleNamespace(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL=9)

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self._local = threading.local()
        self._handles = itertools.count(1)
        self.refused = 0  # calls refused for want of a current context (for tests)

    # -- contexts ---------------------------------------------------------------------------
    def _stack(self) -> list[int]:
        stack: list[int] = self._local.__dict__.setdefault("stack", [])
        return stack

    def cuInit(self, flags: int) -> tuple[int]:
        return (0,)

    def cuDeviceGetCount(self) -> tuple[int, int]:
        return 0, self.devices

    def cuDeviceGet(self, ordinal: int) -> tuple[int, int]:
        return (0, ordinal) if 0 <= ordinal < self.devices else (1, 0)

    def cuDevicePrimaryCtxRetain(self, device: int) -> tuple[int, int]:
        return 0, _CONTEXT_BASE + device

    def cuCtxGetCurrent(self) -> tuple[int, int]:
        stack = self._stack()
        return 0, stack[-1] if stack else 0

    def cuCtxSetCurrent(self, context: int) -> tuple[int]:
        stack = self._stack()
        if stack:
            stack[-1] = context
        else:
            stack.append(context)
        return (0,)

    def cuCtxPushCurrent(self, context: int) -> tuple[int]:
        self._stack().append(context)
        return (0,)

    def cuCtxPopCurrent(self) -> tuple[int, int]:
        stack = self._stack()
        return (0, stack.pop()) if stack else (INVALID_CONTEXT, 0)

    def has_context(self) -> bool:
        """True when the calling thread has a current context."""
        return bool(self._stack())

    def _refuse(self) -> bool:
        if self.has_context():
            return False
        self.refused += 1
        return True

    # -- what needs a context ---------------------------------------------------------------
    def cuCtxGetDevice(self) -> tuple[int, int]:
        if self._refuse():
            return INVALID_CONTEXT, 0
        return 0, self._stack()[-1] - _CONTEXT_BASE

    def cuPointerGetAttribute(self, attribute: Any, pointer: int) -> tuple[int, int]:
        return 0, 0  # every simulated pointer is host memory standing in for device 0

    def cuStreamCreate(self, flags: int) -> tuple[int, int]:
        if self._refuse():
            return INVALID_CONTEXT, 0
        return 0, next(self._handles)

    def cuEventCreate(self, flags: int) -> tuple[int, int]:
        if self._refuse():
            return INVALID_CONTEXT, 0
        return 0, next(self._handles)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> tuple[int]:
        """One copy; done at once here (subclasses may queue it on ``stream``)."""
        ctypes.memmove(dst, src, nbytes)
        return (0,)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple[int]:
        return (INVALID_CONTEXT,) if self._refuse() else self.copy(dst, src, nbytes, stream)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple[int]:
        return (INVALID_CONTEXT,) if self._refuse() else self.copy(dst, src, nbytes, stream)

    def cuEventRecord(self, event: int, stream: int) -> tuple[int]:
        return (INVALID_CONTEXT,) if self._refuse() else (0,)

    def cuStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[int]:
        return (INVALID_CONTEXT,) if self._refuse() else (0,)

    def cuEventQuery(self, event: int) -> tuple[int]:
        return (INVALID_CONTEXT,) if self._refuse() else (0,)

    def cuStreamSynchronize(self, stream: int) -> tuple[int]:
        return (INVALID_CONTEXT,) if self._refuse() else (0,)

    # -- errors -------------------------------------------------------------------------------
    def cuGetErrorName(self, err: int) -> tuple[int, bytes]:
        return 0, _NAMES.get(int(err), f"CUDA_ERROR_{int(err)}").encode()

    def cuGetErrorString(self, err: int) -> tuple[int, bytes]:
        text = "invalid device context" if int(err) == INVALID_CONTEXT else "simulated driver"
        return 0, text.encode()
