"""A plan: what one kind of collective call does on this rank, decided once.

The route (``_route``) makes plans and keeps them per call signature; the runner
(``_runner``) runs them. A plan is a frozen value that prints itself, which is what
``FERRODIST_DEBUG=route`` shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ferrodist.core import DType, ReduceOp

__all__ = ["Body", "NativeCall", "Plan"]

Body = Callable[..., None]
#: A transport's own collective bound to one kind of call: ``(array, deadline, fingerprint, seq)``.
NativeCall = Callable[[Any, float, int, int], None]


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What one kind of call does, decided once.

    ``route`` names where it runs: a device engine (``"nccl"``, ``"staged"``), the
    transport's own collective (``"transport"``), the two levels of a job that spans nodes
    (``"levels"``) or our algorithm (``"ring"``,
    ``"recursive_doubling"``, ``"tree"``, ``"direct"``, ``"dissemination"``).
    ``body(call, *arrays)`` runs it inside the call: device ``Tensor`` objects for a device
    engine, else flat host arrays and ``Blocks``. ``native_call``, where the transport's own
    collective bound itself to this kind of call (``NativeCollectives.bound_all_reduce``),
    does what ``body`` does, called as ``native_call(array, deadline, fingerprint, seq)``
    with no ``Call`` made.
    """

    operation: str
    route: str
    dtype: DType | None
    count: int
    op: ReduceOp | None
    root: int | None
    divisor: float
    fingerprint: int
    body: Body = dataclasses.field(repr=False, compare=False)
    native_call: NativeCall | None = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        words = [self.operation]
        if self.dtype is not None:
            words.append(f"{self.dtype.name} x{self.count}")
        if self.op is not None:
            words.append(self.op.name)
        if self.root is not None:
            words.append(f"root {self.root}")
        words.append(f"-> {self.route}")
        if self.divisor != 1.0:
            words.append(f"(then divided by {self.divisor:g})")
        return " ".join(words) + f" [fingerprint {self.fingerprint:#018x}]"
