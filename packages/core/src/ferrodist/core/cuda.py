"""CUDA plumbing that ferrodist's GPU packages share (public): the driver, contexts per
thread, the one map from CUDA status codes to ferrodist errors, and the simulator check.

Nothing here imports ``numba.cuda`` or cuda-python until it is called.

Example::

    from ferrodist.core import cuda

    with cuda.on_device(0):                      # this thread: device 0's primary context
        stream = cuda.check(cuda.driver().cuStreamCreate(0), "cuStreamCreate")
"""

from ._cuda import (
    SIMULATED,
    check,
    current_device,
    device_of,
    driver,
    error,
    has_context,
    on_device,
    on_device_of,
    simulated,
)
from ._cuda import cuda as numba_cuda
from ._cuda_sim import SimulatedDriver

__all__ = [
    "SIMULATED",
    "SimulatedDriver",
    "check",
    "current_device",
    "device_of",
    "driver",
    "error",
    "has_context",
    "numba_cuda",
    "on_device",
    "on_device_of",
    "simulated",
]
