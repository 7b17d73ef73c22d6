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

from collections.abc import Callable, Sequence
from typing import Any

from numba.core.dispatcher import Dispatcher

from .background import Front, NotCompiled, background, prepare

__all__ = ["Later", "Twin", "queue_missing"]


Item = tuple[Any, tuple[Any, ...]]  # (front, argument types), as ``prepare`` takes them


def queue_missing(missing: NotCompiled) -> None:
    """What a miss queues by default: the compile of the function it missed, for its types."""
    prepare([(missing.front, missing.types)])


class Twin:
    """``compiled`` and ``interpreted``, called as one: the compiled code where it is loaded
    for the arguments' types, else the interpreted one, with the compile queued.

    ``compiled`` is a function of ``jit`` (called through its front), or a Python function
    that drives compiled loops and calls their fronts before it does anything else, so that
    a missing loop raises :class:`NotCompiled` before any of its work. ``interpreted`` takes
    the same arguments and gives the same results and return value, to the bit. ``queue``:
    what a miss queues (default: that function's compile for those types; a :class:`Later`
    waits for a number of misses first)."""

    __slots__ = ("call", "compiled", "front", "interpreted", "queue")

    def __init__(
        self,
        compiled: Any,
        interpreted: Callable[..., Any],
        *,
        queue: Callable[[NotCompiled], None] = queue_missing,
    ) -> None:
        self.front: Front | None = None
        if isinstance(compiled, Dispatcher):
            self.front = compiled if isinstance(compiled, Front) else background(compiled)
            compiled = self.front
        self.compiled: Callable[..., Any] = compiled
        self.interpreted = interpreted
        self.queue = queue
        self.call = _caller(compiled, interpreted, queue)

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)

    @property
    def name(self) -> str:
        return str(getattr(self.compiled, "__qualname__", None) or self.compiled.py_func.__qualname__)  # type: ignore[attr-defined]

    def ready(self, *args: Any) -> bool:
        """Whether a jit twin has compiled code loaded for these arguments' types."""
        assert self.front is not None, f"{self!r} drives its loops; ask their fronts"
        types = tuple(self.front.typeof_pyval(a) for a in args)
        return types in self.front.overloads

    def __repr__(self) -> str:
        twin = getattr(self.interpreted, "__qualname__", repr(self.interpreted))
        return f"Twin({self.name}, interpreted: {twin})"


def _caller(
    compiled: Callable[..., Any], interpreted: Callable[..., Any], queue: Callable[[NotCompiled], None]
) -> Callable[..., Any]:
    """The choice a ``Twin`` makes, as a plain function (``Twin.call``): a hot path that holds
    it pays one call, not an object's."""

    def call(*args: Any) -> Any:
        try:
            return compiled(*args)
        except NotCompiled as missing:
            queue(missing)
            return interpreted(*args)

    return call


class Later:
    """A family of loops not worth compiling at their first miss: ``items()`` are queued
    (each a request of its own, in order) once ``after`` calls have run interpreted. A
    process's first few calls (a job's start) then share no core with a compiler, and a
    long run gets the compiled code. Pass its ``missed`` as a :class:`Twin`'s ``queue``."""

    def __init__(self, items: Callable[[], Sequence[Item]], after: int) -> None:
        self.items = items
        self.after = after
        self.misses = 0
        self.queued = False

    def missed(self, missing: NotCompiled) -> None:
        self.misses += 1
        if self.misses >= self.after and not self.queued:
            self.queued = True
            for item in self.items():
                prepare([item])
