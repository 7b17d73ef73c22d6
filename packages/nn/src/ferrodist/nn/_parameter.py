"""A trainable array with an accumulated gradient and post-accumulate hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Array", "Parameter", "RemovableHandle"]

Array = np.ndarray[Any, Any]
Hook = Callable[["Parameter"], None]


class RemovableHandle:
    """What ``register_post_accumulate_grad_hook`` returns: ``remove()`` unregisters the hook.

    Removing twice is harmless. Usable as a context manager (the hook is removed on exit).
    """

    def __init__(self, hooks: dict[int, Hook], key: int) -> None:
        self._hooks = hooks
        self._key = key

    def remove(self) -> None:
        """Unregister the hook; it is not called again, not even later in a running backward."""
        self._hooks.pop(self._key, None)

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _check_array(value: object, like: Parameter, what: str) -> Array:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"Parameter.{what} must be a numpy array, got {type(value).__name__}")
    if value.shape != like.shape or value.dtype != like.dtype:
        raise ValueError(
            f"Parameter.{what}: got an array of shape {value.shape} and dtype {value.dtype}, "
            f"the parameter has shape {like.shape} and dtype {like.dtype}; pass an array of that shape and dtype"
        )
    if not value.flags.writeable:
        raise ValueError(f"Parameter.{what}: the array is read-only; pass a writeable array")
    return value


class Parameter:
    """A trainable numpy array (``.data``) and its accumulated gradient (``.grad``).

    ``.data`` keeps the array it was given (no copy, same dtype, which must be floating).
    ``.grad`` is ``None`` until the first :meth:`accumulate_grad`, which allocates it; later
    accumulations add into it in place, so a ``.grad`` that other code set to a view into a
    larger buffer (DDP's gradient buckets) stays that view. Both setters accept only writeable
    arrays of the parameter's shape and dtype (``.grad`` also ``None``) and keep the array given.

    Args:
        data: the initial values; a numpy array (shared, not copied) or anything
            ``np.asarray`` accepts, of a floating dtype.

    Raises:
        ValueError: ``data`` is not floating point or is read-only.

    Example:
        >>> p = Parameter(np.zeros(2))
        >>> seen = []
        >>> handle = p.register_post_accumulate_grad_hook(lambda q: seen.append(q.grad.copy()))
        >>> p.accumulate_grad(np.array([1.0, 2.0]))
        >>> p.accumulate_grad(np.array([1.0, 1.0]))
        >>> p.grad, len(seen)
        (array([2., 3.]), 2)
    """

    def __init__(self, data: object) -> None:
        array = np.asarray(data)
        if array.dtype.kind != "f":
            raise ValueError(f"Parameter needs a floating-point array, got dtype {array.dtype}")
        if not array.flags.writeable:
            raise ValueError("Parameter needs a writeable array (optimizers update .data in place)")
        self._data: Array = array
        self._grad: Array | None = None
        self._hooks: dict[int, Hook] = {}
        self._next_hook = 0

    @property
    def data(self) -> Array:
        """The values; optimizers and ``load_state_dict`` update this array in place."""
        return self._data

    @data.setter
    def data(self, value: Array) -> None:
        self._data = _check_array(value, self, "data")

    @property
    def grad(self) -> Array | None:
        """The accumulated gradient, or ``None`` before the first backward."""
        return self._grad

    @grad.setter
    def grad(self, value: Array | None) -> None:
        self._grad = None if value is None else _check_array(value, self, "grad")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._data.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._data.dtype

    @property
    def size(self) -> int:
        return int(self._data.size)

    def accumulate_grad(self, g: Array) -> None:
        """Add ``g`` to ``.grad`` (allocating a private copy on the first call), then call the hooks.

        The addition is in place (``np.add(grad, g, out=grad)``), so a ``.grad`` that is a
        view stays that view. Hooks run in registration order, after the addition.

        Raises:
            ValueError: ``g`` does not have the parameter's shape.
        """
        g = np.asarray(g)
        if g.shape != self.shape:
            raise ValueError(
                f"Parameter.accumulate_grad: gradient of shape {g.shape} for a parameter of shape {self.shape}"
            )
        if self._grad is None:
            self._grad = np.array(g, dtype=self.dtype, copy=True)
        else:
            np.add(self._grad, g, out=self._grad)
        for key in list(self._hooks):
            hook = self._hooks.get(key)  # None: an earlier hook of this round removed it
            if hook is not None:
                hook(self)

    def register_post_accumulate_grad_hook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook(param)`` after every :meth:`accumulate_grad` (PyTorch's name and timing).

        Within a module's backward a parameter's gradient is accumulated once, when it is
        final, so the hook sees the finished ``.grad`` (a parameter used twice in one
        forward is accumulated, and its hooks called, once per use).

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        if not callable(hook):
            raise TypeError(f"register_post_accumulate_grad_hook needs a callable, got {type(hook).__name__}")
        key = self._next_hook
        self._next_hook += 1
        self._hooks[key] = hook
        return RemovableHandle(self._hooks, key)

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"
