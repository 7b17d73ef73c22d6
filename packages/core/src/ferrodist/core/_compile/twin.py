"""A compiled loop and its interpreted twin, declared as one object.

Every loop that ferrodist compiles with Numba and calls from Python has a twin in Python
(numpy, or the same protocol step by step) that gives the same results to the bit: a call
runs the compiled code where it is loaded, and the twin while it compiles in the background
(``background``). A :class:`Twin` holds the pair, and calling it is that choice: the
compiled code through its front, or, when the front has no code for these argument types
yet (:class:`NotCompiled`, raised before any of it runs), the compile queued and the twin
run. Call sites hold a twin and call it; none catches ``NotCompiled`` itself.

Example:
    >>> import numpy as np
    >>> from ferrodist.core.kernels import Twin, jit
    >>> @jit
    ... def double(x):
    ...     for i in range(x.shape[0]):
    ...         x[i] *= 2
    >>> def double_numpy(x):
    ...     x *= 2
    >>> twice = Twin(double, double_numpy)
    >>> x = np.ones(3)
    >>> twice(x)  # numpy until the compiled code is ready, then the compiled loop
    >>> x
    array([2., 2., 2.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .background import Front, NotCompiled, Ticket, background, prepare

__all__ = ["Twin"]


class Twin:
    """``compiled`` (a function of ``jit``) and ``interpreted`` (a Python function taking
    the same arguments and giving the same results and return value, to the bit), called as
    one: the compiled code where it is loaded for the arguments' types, else the interpreted
    one, with the compile queued."""

    __slots__ = ("front", "interpreted")

    def __init__(self, compiled: Any, interpreted: Callable[..., Any]) -> None:
        self.front: Front = background(compiled)
        self.interpreted = interpreted

    def __call__(self, *args: Any) -> Any:
        try:
            return self.front(*args)
        except NotCompiled as missing:
            prepare([(missing.front, missing.types)])
            return self.interpreted(*args)

    @property
    def name(self) -> str:
        return str(self.front.py_func.__qualname__)

    def ready(self, *args: Any) -> bool:
        """Whether compiled code for these arguments' types is loaded (the next call runs it)."""
        types = tuple(self.front.typeof_pyval(a) for a in args)
        return types in self.front.overloads

    def prepare(self, *signatures: tuple[Any, ...], always: bool = False) -> Ticket:
        """Queue the compile (or the load from the disk cache) for each signature (Numba
        types); ``always=True`` compiles even under ``FERRODIST_KERNELS=interpreted``, for
        code that a caller waits for. The ticket says when all of them are ready."""
        return prepare([(self.front, tuple(signature)) for signature in signatures], always=always)

    def __repr__(self) -> str:
        twin = getattr(self.interpreted, "__qualname__", repr(self.interpreted))
        return f"Twin({self.name}, interpreted: {twin})"
