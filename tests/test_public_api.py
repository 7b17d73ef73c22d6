"""Each package's public surface is exactly the set written here, so API changes are deliberate.

Changing a package's ``__all__`` means changing this file in the same commit.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC_API: dict[str, set[str]] = {
    "ferrodist.core": {
        "ALL_DTYPES",
        "AuthenticationFailed",
        "BackendUnavailable",
        "CollectiveMismatch",
        "CollectiveTimeout",
        "DType",
        "Device",
        "DeviceUnavailable",
        "FerrodistError",
        "GroupAborted",
        "Group",
        "InvalidArgument",
        "InvalidRank",
        "NotInitialized",
        "PeerLost",
        "ProtocolError",
        "ReduceOp",
        "Tensor",
        "Work",
        "as_tensor",
        "bfloat16",
        "bool_",
        "check_op",
        "device",
        "dtype",
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "reduce_into",
        "reduce_many",
        "reducer",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    },
    "ferrodist.core.kernels": {
        "AVG",
        "BAND",
        "BF16",
        "BOR",
        "BXOR",
        "F16",
        "MAX",
        "MAX_FUSED_SOURCES",
        "MIN",
        "PLAIN",
        "PRODUCT",
        "SUM",
        "combine",
        "copy_into",
        "finish",
        "fold_kernel",
        "jit",
        "load",
        "load_acquire",
        "pairwise_opcode",
        "plan",
        "store",
        "store_release",
    },
    "ferrodist.transport": {
        "DEFAULT_TIMEOUT",
        "Faults",
        "KeyValue",
        "LaunchInfo",
        "MpiCollectives",
        "MpiTransport",
        "NativeCollectives",
        "Notice",
        "Request",
        "ShmCollectives",
        "ShmTransport",
        "SimulatedTransport",
        "Store",
        "StoreClient",
        "StoreServer",
        "TcpTransport",
        "Transport",
        "interface_address",
        "launch_info",
        "local_address",
    },
    "ferrodist.collectives": {
        "ALL_REDUCE_ALGORITHMS",
        "ProcessGroup",
        "ReduceOp",
        "SMALL_MESSAGE_BYTES",
        "Work",
        "all_gather",
        "all_reduce",
        "all_to_all",
        "barrier",
        "broadcast",
        "default_group",
        "destroy_process_group",
        "gather",
        "get_rank",
        "get_world_size",
        "init_process_group",
        "irecv",
        "is_initialized",
        "isend",
        "new_group",
        "recv",
        "reduce",
        "reduce_scatter",
        "scatter",
        "send",
    },
    "ferrodist.testing": {
        "assert_reduced",
        "reduce_values",
        "reduction_tolerance",
        "ref_all_gather",
        "ref_all_reduce",
        "ref_all_to_all",
        "ref_broadcast",
        "ref_gather",
        "ref_reduce",
        "ref_reduce_scatter",
        "ref_scatter",
        "run_world",
        "strategies",
    },
    "ferrodist.ddp": {
        "DDP",
        "DEFAULT_FIRST_BUCKET_MB",
        "BucketPlan",
        "BucketSpec",
        "CheckpointError",
        "DistributedDataParallel",
        "GradBucket",
        "ParamSpec",
        "PowerSGD",
        "StepStats",
        "StragglerReport",
        "allreduce",
        "bf16_compress",
        "fp16_compress",
        "load_checkpoint",
        "plan_buckets",
        "powersgd",
        "save_checkpoint",
    },
    "ferrodist.pipeline": {
        "Action",
        "CustomSchedule",
        "GPipe",
        "Interleaved1F1B",
        "OneFOneB",
        "Pipeline",
        "Schedule",
        "ScheduleError",
        "Slot",
        "Stage",
        "Timeline",
        "ZeroBubbleH1",
        "simulate",
        "split_sequential",
        "validate",
    },
    "ferrodist.nn": {
        "Adam",
        "CrossEntropyLoss",
        "Linear",
        "MSELoss",
        "Module",
        "Optimizer",
        "Parameter",
        "ReLU",
        "RemovableHandle",
        "SGD",
        "Sequential",
        "Tanh",
    },
    "ferrodist.gpu": {
        "MAX_ARRAYS_PER_LAUNCH",
        "MAX_BLOCKS",
        "SEGMENT_BYTES",
        "THREADS_PER_BLOCK",
        "StagedEngine",
        "StagingStats",
        "cast",
        "engine",
        "launch_config",
        "pack",
        "reduce_into",
        "scale",
        "unpack",
    },
    "ferrodist.nccl": {
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
    },
}

PACKAGES = sorted(PUBLIC_API)


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_the_agreed_set(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{name}.__all__ lists a name twice"
    assert set(exported) == PUBLIC_API[name], (
        f"{name}.__all__ changed: added {sorted(set(exported) - PUBLIC_API[name])}, "
        f"removed {sorted(PUBLIC_API[name] - set(exported))}; if deliberate, update tests/test_public_api.py"
    )


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted(name: str) -> None:
    exported = list(importlib.import_module(name).__all__)
    assert exported == sorted(exported), f"{name}.__all__ is not in sorted() order; expected {sorted(exported)}"


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_exists(name: str) -> None:
    module = importlib.import_module(name)
    missing = [attr for attr in module.__all__ if not hasattr(module, attr)]
    assert not missing, f"{name}.__all__ lists names the module does not define: {missing}"
