"""Gradient buckets as data: which parameter's gradient lives where in which flat buffer.

A plan is computed from the parameters' names, sizes and dtypes alone, so tests can check
it (every parameter placed once, no overlap, reverse registration order, caps kept) and
print it without a model or a group. The engine in ``_reducer`` only executes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_FIRST_BUCKET_MB", "BucketPlan", "BucketSpec", "ParamSpec", "plan_buckets"]

#: The first bucket (the last parameters, whose gradients are ready first) is kept small so
#: that communication starts early in backward; PyTorch uses 1 MB too.
DEFAULT_FIRST_BUCKET_MB = 1.0


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know of one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy-style name: "float32", "float64", ...
    itemsize: int
    device: str = "cpu"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class BucketSpec:
    """One flat buffer: ``params[i]`` (an index into the module's parameter list) occupies
    ``offsets[i] : offsets[i] + numels[i]`` of it, in the order its gradient is expected."""

    index: int
    dtype: str
    device: str
    params: tuple[int, ...]
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    """Every bucket, in the order their all_reduces start (bucket 0 first)."""

    buckets: tuple[BucketSpec, ...]
    cap_bytes: int
    first_cap_bytes: int

    def where(self, param: int) -> tuple[int, int]:
        """``(bucket, slot)`` holding parameter ``param``."""
        for bucket in self.buckets:
            if param in bucket.params:
                return bucket.index, bucket.params.index(param)
        raise KeyError(param)

    def describe(self) -> str:
        """One line per bucket: its size and its parameters, for logs and tests."""
        lines = []
        for b in self.buckets:
            mib = b.nbytes / 2**20
            lines.append(
                f"bucket {b.index}: {b.dtype} on {b.device}, {b.numel} elements ({mib:.2f} MiB): {', '.join(b.names)}"
            )
        return "\n".join(lines)


def plan_buckets(
    params: Sequence[ParamSpec], *, cap_mb: float = 25.0, first_cap_mb: float = DEFAULT_FIRST_BUCKET_MB
) -> BucketPlan:
    """Place parameters in buckets: reverse registration order (the order backward
    finishes their gradients), one dtype and device per bucket, a bucket closed once it
    holds ``cap_mb`` (``first_cap_mb`` for the first one). A parameter larger than a cap
    gets a bucket of its own.

    >>> p = [ParamSpec("w1", (4, 3), "float64", 8), ParamSpec("b1", (4,), "float64", 8)]
    >>> [b.names for b in plan_buckets(p, cap_mb=1e-4, first_cap_mb=1e-5).buckets]
    [('b1',), ('w1',)]
    """
    if cap_mb <= 0 or first_cap_mb <= 0:
        raise ValueError(f"bucket caps must be positive (got cap_mb={cap_mb}, first_cap_mb={first_cap_mb})")
    cap = int(cap_mb * 2**20)
    first_cap = int(min(first_cap_mb, cap_mb) * 2**20)
    open_: dict[tuple[str, str], list[int]] = {}  # (dtype, device) -> parameter indices of its open bucket
    closed: list[list[int]] = []

    def used(members: list[int]) -> int:
        return sum(params[i].nbytes for i in members)

    for i in reversed(range(len(params))):
        key = (params[i].dtype, params[i].device)
        members = open_.setdefault(key, [])
        if members and params[i].nbytes >= (first_cap if not closed else cap):
            # Alone: no copy of its gradient into a shared buffer (DDP averages a PyTorch
            # gradient of a bucket of its own where autograd left it).
            closed.append(members)
            members = open_[key] = []
        members.append(i)
        limit = first_cap if not closed else cap
        if used(members) >= limit:
            closed.append(members)
            del open_[key]
    # Buckets still open close in the order of their first parameter (reverse registration).
    closed += sorted(open_.values(), key=lambda m: -m[0])
    closed.sort(key=lambda m: -m[0])  # start order: the bucket whose first gradient comes first

    buckets = []
    for index, members in enumerate(closed):
        offsets, numels, offset = [], [], 0
        for i in members:
            offsets.append(offset)
            numels.append(params[i].numel)
            offset += params[i].numel
        first = params[members[0]]
        buckets.append(
            BucketSpec(
                index=index,
                dtype=first.dtype,
                device=first.device,
                params=tuple(members),
                names=tuple(params[i].name for i in members),
                offsets=tuple(offsets),
                numels=tuple(numels),
                shapes=tuple(params[i].shape for i in members),
                numel=offset,
                nbytes=offset * first.itemsize,
            )
        )
    return BucketPlan(buckets=tuple(buckets), cap_bytes=cap, first_cap_bytes=first_cap)
