"""ferrodist.ddp: DistributedDataParallel for ``ferrodist.nn`` and PyTorch modules over any
group: zero-copy gradient buckets, overlap with backward, ``no_sync``, unused parameters,
``join`` for uneven inputs, communication hooks (fp16, bf16, PowerSGD), a straggler
report and atomic checkpoints."""

from ._buckets import DEFAULT_FIRST_BUCKET_MB, BucketPlan, BucketSpec, ParamSpec, plan_buckets
from ._checkpoint import CheckpointError, load_checkpoint, resume_checkpoint, save_checkpoint
from ._ddp import DDP, DistributedDataParallel
from ._hooks import GradBucket, PowerSGD, allreduce, bf16_compress, fp16_compress, powersgd
from ._stats import StepStats, StragglerReport

__all__ = [
    "BucketPlan",
    "BucketSpec",
    "CheckpointError",
    "DDP",
    "DEFAULT_FIRST_BUCKET_MB",
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
    "resume_checkpoint",
    "save_checkpoint",
]
