"""The kit's layers: Linear, ReLU, Tanh and Sequential."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, overload

import numpy as np

from ._module import Module
from ._parameter import Array, Parameter

__all__ = ["Linear", "ReLU", "Sequential", "Tanh"]


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"Linear: {what} must be a positive integer, got {value!r}")
    return int(value)


def _check_grad(module: Module, grad_output: object, shape: tuple[int, ...]) -> Array:
    grad = np.asarray(grad_output)
    if grad.shape != shape:
        raise ValueError(
            f"{type(module).__name__}.backward: grad_output has shape {grad.shape}, the forward's output had {shape}"
        )
    return grad


class Linear(Module):
    """``y = x @ weight.T + bias`` on inputs of shape ``(batch, in_features)``.

    ``weight`` has shape ``(out_features, in_features)``. Both parameters start uniform in
    ``[-1/sqrt(in_features), 1/sqrt(in_features))`` (PyTorch's default range), weight drawn
    first. The forward keeps a copy of its input, and ``backward_input`` a copy of its
    gradient, so callers may reuse their buffers. The weight gradient is accumulated before
    the bias gradient, so within one Linear the weight's hooks fire first.

    Args:
        in_features: size of each input row.
        out_features: size of each output row.
        bias: whether to add a learnt bias.
        rng: a ``np.random.Generator``, an integer seed, or ``None`` (fresh entropy).
        dtype: the parameters' floating dtype; inputs are cast to it.

    Example:
        >>> layer = Linear(3, 2, rng=0)
        >>> y = layer(np.ones((4, 3)))             # shape (4, 2)
        >>> gx = layer.backward(np.ones((4, 2)))   # shape (4, 3); layer.weight.grad is set
    """

    weight: Parameter
    bias: Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        rng: np.random.Generator | int | None = None,
        dtype: Any = np.float64,
    ) -> None:
        super().__init__()
        self.in_features = _positive_int(in_features, "in_features")
        self.out_features = _positive_int(out_features, "out_features")
        dt = np.dtype(dtype)
        if dt.kind != "f":
            raise ValueError(f"Linear: dtype must be floating point, got {dt}")
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        bound = 1.0 / np.sqrt(self.in_features)
        self.weight = Parameter(gen.uniform(-bound, bound, (self.out_features, self.in_features)).astype(dt))
        self.bias = Parameter(gen.uniform(-bound, bound, self.out_features).astype(dt)) if bias else None

    def forward(self, x: Array) -> Array:
        x = np.array(x, dtype=self.weight.dtype)  # a copy: the caller may reuse its buffer
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Linear.forward: expected input of shape (batch, {self.in_features}), got {x.shape}")
        y: Array = x @ self.weight.data.T
        if self.bias is not None:
            y += self.bias.data
        self._saved = x
        return y

    def backward_input(self, grad_output: Array) -> Array:
        if self._saved is not None:
            _check_grad(self, grad_output, (self._saved.shape[0], self.out_features))
        x = self._take_saved("backward_input")
        grad = np.array(grad_output, dtype=self.weight.dtype)
        self._pending.append((x, grad))
        grad_input: Array = grad @ self.weight.data
        return grad_input

    def backward_weight(self) -> None:
        """Accumulate the pending weight gradient, then the bias gradient (hooks fire in that order).

        Raises:
            RuntimeError: nothing is pending (``backward_input`` did not run since the last call).
        """
        if not self._pending:
            raise RuntimeError("Linear.backward_weight: nothing pending; call backward_input first")
        pending, self._pending = self._pending, []
        self.weight.accumulate_grad(sum(g.T @ x for x, g in pending))
        if self.bias is not None:
            self.bias.accumulate_grad(sum(g.sum(axis=0) for _, g in pending))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ReLU(Module):
    """``max(x, 0)`` element-wise (gradient 0 at 0, as PyTorch)."""

    def forward(self, x: Array) -> Array:
        x = np.asarray(x)
        self._saved = x > 0
        out: Array = np.where(self._saved, x, np.zeros((), x.dtype))
        return out

    def backward_input(self, grad_output: Array) -> Array:
        if self._saved is not None:
            _check_grad(self, grad_output, self._saved.shape)
        mask = self._take_saved("backward_input")
        out: Array = np.where(mask, grad_output, np.zeros((), np.asarray(grad_output).dtype))
        return out


class Tanh(Module):
    """``tanh(x)`` element-wise."""

    def forward(self, x: Array) -> Array:
        y: Array = np.tanh(np.asarray(x))
        self._saved = 1 - y * y  # the derivative, a fresh array (the caller may modify y)
        return y

    def backward_input(self, grad_output: Array) -> Array:
        if self._saved is not None:
            _check_grad(self, grad_output, self._saved.shape)
        derivative = self._take_saved("backward_input")
        out: Array = np.asarray(grad_output) * derivative
        return out


class Sequential(Module):
    """Children applied in order; backward runs them in reverse.

    Children are named ``"0"``, ``"1"``, ... (so parameters are ``"0.weight"`` etc.).
    ``backward`` runs each child's full backward from the last one to the first, so the
    last layer's parameters are final (and their hooks fire) before earlier layers' input
    gradients are computed. ``backward_input`` and ``backward_weight`` also go in reverse.
    Indexing with a slice gives a new Sequential sharing the same children (a pipeline stage).

    Example:
        >>> model = Sequential(Linear(4, 8, rng=0), ReLU(), Linear(8, 2, rng=1))
        >>> len(model), model[0].weight.shape, len(model[1:])
        (3, (8, 4), 2)
    """

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        seen: set[int] = set()
        for index, module in enumerate(modules):
            if not isinstance(module, Module):
                raise TypeError(f"Sequential: argument {index} is a {type(module).__name__}, not a Module")
            for part in module.modules():
                if id(part) in seen:
                    raise ValueError(
                        f"Sequential: argument {index} repeats the module {part!r}; a module keeps one forward "
                        "for its backward, so use it once (to tie weights, share its Parameter instead)"
                    )
                seen.add(id(part))
            setattr(self, str(index), module)

    def _children(self) -> list[Module]:
        return list(self._modules.values())

    @overload
    def __getitem__(self, index: int) -> Module: ...
    @overload
    def __getitem__(self, index: slice) -> Sequential: ...
    def __getitem__(self, index: int | slice) -> Module | Sequential:
        if isinstance(index, slice):
            return Sequential(*self._children()[index])
        return self._children()[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._children())

    def forward(self, x: Array) -> Array:
        for module in self._children():
            x = module(x)
        return x

    def backward(self, grad_output: Array) -> Array:
        for module in reversed(self._children()):
            grad_output = module.backward(grad_output)
        return grad_output

    def backward_input(self, grad_output: Array) -> Array:
        for module in reversed(self._children()):
            grad_output = module.backward_input(grad_output)
        return grad_output
