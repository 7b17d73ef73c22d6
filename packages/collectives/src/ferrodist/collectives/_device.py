"""Collectives on device tensors: the engine for a device type is found by entry point.

collectives cannot import ``ferrodist.gpu`` (gpu is built on collectives), so a package
that can run collectives on a device type advertises an engine under the entry-point
group ``ferrodist.device_engines`` (``cuda = "ferrodist.gpu._staged:StagedEngine"``).
A ``ProcessGroup`` validates arguments, fingerprints the call and runs it under its
deadline exactly as for CPU tensors, and hands the engine a ``Call`` plus flat device
arrays instead of running a CPU algorithm.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from ferrodist.core import DeviceUnavailable, InvalidArgument, Tensor

GROUP = "ferrodist.device_engines"


@functools.cache
def _engine(device_type: str) -> Any:
    found = [ep for ep in entry_points(group=GROUP) if ep.name == device_type]
    if not found:
        raise DeviceUnavailable(
            f"collectives on {device_type} tensors need ferrodist-gpu (pip install ferrodist-gpu): "
            f"no package provides a {device_type!r} engine in the {GROUP!r} entry points"
        )
    return found[0].load()()


def engine(rank: int, operation: str, tensors: Sequence[Tensor]) -> Any:
    """The device engine for ``tensors`` (all on one device type), or None for CPU tensors."""
    kinds = {t.device.type for t in tensors}
    if kinds == {"cpu"}:
        return None
    if len(kinds) > 1:
        raise InvalidArgument(
            f"rank {rank}: {operation}: the tensors are on different devices ({', '.join(sorted(kinds))}); "
            "put them all on the CPU or all on the GPU",
            rank=rank,
            operation=operation,
        )
    try:
        return _engine(kinds.pop())
    except DeviceUnavailable as exc:
        raise exc.with_context(f"rank {rank}: {operation}") from None
