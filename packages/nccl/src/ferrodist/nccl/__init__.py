"""ferrodist.nccl: collectives on GPU memory through NVIDIA's NCCL (``libnccl.so.2``, via ctypes).

The library comes from the ``nvidia-nccl-cu12``/``-cu13`` wheel or ``$FERRODIST_NCCL_LIB``;
CUDA streams and devices go through cuda-python. Nothing is loaded at import.
"""

from ._communicator import NcclCommunicator
from ._config import DEFAULT_TIMEOUT, NcclConfig
from ._cuda import device_count
from ._group import NcclGroup, init_nccl
from ._ids import get_unique_id
from ._library import UNIQUE_ID_BYTES, is_available, library_path, nccl_version
from ._work import NcclWork

__all__ = [
    "DEFAULT_TIMEOUT",
    "NcclCommunicator",
    "NcclConfig",
    "NcclGroup",
    "NcclWork",
    "UNIQUE_ID_BYTES",
    "device_count",
    "get_unique_id",
    "init_nccl",
    "is_available",
    "library_path",
    "nccl_version",
]
