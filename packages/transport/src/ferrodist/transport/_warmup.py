"""What the transports compile, declared in one place: ``ferrodist warm`` fills the cache
with it, ``ferrodist doctor`` says how much of it is there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferrodist.core import DType

from ._shm.fronts import pipeline_kernels
from ._shm.spin import wait_kernels
from ._tcp.compiled import frame_kernels

__all__ = ["transport_kernels"]


def transport_kernels(dtypes: Sequence[DType]) -> list[tuple[Any, tuple[Any, ...]]]:
    """The transports' compiled code for collectives over ``dtypes``: the shared-memory
    waits (which a shared-memory start waits for), tcp's small frames, and the
    shared-memory loops for those dtypes; ``ferrodist.core.kernels.warm`` takes the list."""
    return [*wait_kernels(), *frame_kernels(), *pipeline_kernels(dtypes)]
