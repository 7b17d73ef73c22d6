"""ferrodist.gpu: collectives on CUDA tensors staged through the host, and the Numba CUDA
kernels they use (bucket pack/unpack, reduce, cast, scale).

With this package installed, every collective of a ``ProcessGroup`` accepts CUDA tensors;
nothing needs importing from here for that. Without a GPU, set ``NUMBA_ENABLE_CUDASIM=1``.
"""

from ._cuda_buckets import pack, unpack
from ._cuda_kernels import (
    MAX_ARRAYS_PER_LAUNCH,
    MAX_BLOCKS,
    THREADS_PER_BLOCK,
    cast,
    launch_config,
    reduce_into,
    scale,
)
from ._staged import SEGMENT_BYTES, StagedEngine, StagingStats, engine

__all__ = [
    "MAX_ARRAYS_PER_LAUNCH",
    "MAX_BLOCKS",
    "SEGMENT_BYTES",
    "StagedEngine",
    "StagingStats",
    "THREADS_PER_BLOCK",
    "cast",
    "engine",
    "launch_config",
    "pack",
    "reduce_into",
    "scale",
    "unpack",
]
