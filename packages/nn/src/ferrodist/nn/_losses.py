"""Losses: mean-squared error and cross entropy, each with its explicit backward."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._module import _Stateful
from ._parameter import Array

__all__ = ["CrossEntropyLoss", "MSELoss"]

_REDUCTIONS = ("mean", "sum")


class _Loss(_Stateful):
    """``loss(output, target) -> float`` then ``backward() -> gradient of that loss w.r.t. output``.

    Like a module, a loss keeps its last call for one backward and can :meth:`stash` /
    :meth:`restore` it, so several micro-batches may be in flight.
    """

    def __init__(self, *, reduction: str = "mean") -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{type(self).__name__}: reduction must be 'mean' or 'sum', got {reduction!r}")
        self.reduction = reduction
        self._saved: Any = None
        self._pending: list[Any] = []

    def _output(self, output: object) -> Array:
        out = np.asarray(output)
        if out.dtype.kind != "f":
            raise ValueError(f"{type(self).__name__}: output must be floating point, got dtype {out.dtype}")
        return out

    def _divisor(self, count: int) -> int:
        if self.reduction == "sum":
            return 1
        if count == 0:
            raise ValueError(f"{type(self).__name__}: the mean of an empty batch is undefined (use reduction='sum')")
        return count

    def __call__(self, output: Array, target: Array) -> float:
        raise NotImplementedError

    def backward(self) -> Array:
        """The gradient of the last loss with respect to its ``output`` (same shape and dtype).

        Raises:
            RuntimeError: no loss was computed since the last backward.
        """
        grad: Array = self._take_saved("backward")
        return grad

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reduction={self.reduction!r})"


class MSELoss(_Loss):
    """Squared error ``(output - target)**2``, averaged over every element (``"mean"``, as
    PyTorch) or summed (``"sum"``).

    Args:
        reduction: ``"mean"`` (default) or ``"sum"``; summed losses of a batch's shards add
            up to the whole batch's, and so do their gradients.

    Example:
        >>> loss_fn = MSELoss()
        >>> loss_fn(np.array([[1.0, 2.0]]), np.array([[0.0, 0.0]]))
        2.5
        >>> loss_fn.backward()
        array([[1., 2.]])
    """

    def __call__(self, output: Array, target: Array) -> float:
        out = self._output(output)
        tgt = np.asarray(target, dtype=out.dtype)
        if tgt.shape != out.shape:
            raise ValueError(f"MSELoss: target has shape {tgt.shape}, output has {out.shape}")
        diff = out - tgt
        divisor = self._divisor(diff.size)
        self._saved = diff * (2 / divisor)  # the backward is this ready-made gradient
        return float(np.sum(diff * diff) / divisor)


class CrossEntropyLoss(_Loss):
    """Cross entropy of logits ``(batch, classes)`` and integer class targets ``(batch,)``.

    Uses a numerically stable log-softmax (the row maximum is subtracted first), then
    averages the negative log-likelihoods over the batch (``"mean"``) or sums them.

    Example:
        >>> loss_fn = CrossEntropyLoss()
        >>> round(loss_fn(np.array([[0.0, 0.0], [1000.0, 0.0]]), np.array([1, 0])), 6)
        0.346574
        >>> loss_fn.backward()          # (softmax - one_hot) / batch
        array([[ 0.25, -0.25],
               [ 0.  ,  0.  ]])
    """

    def __call__(self, output: Array, target: Array) -> float:
        logits = self._output(output)
        labels = np.asarray(target)
        if logits.ndim != 2:
            raise ValueError(f"CrossEntropyLoss: logits must have shape (batch, classes), got {logits.shape}")
        if labels.dtype.kind not in "iu" or labels.shape != logits.shape[:1]:
            raise ValueError(
                f"CrossEntropyLoss: targets must be integers of shape ({logits.shape[0]},), "
                f"got dtype {labels.dtype} and shape {labels.shape}"
            )
        if labels.size and (labels.min() < 0 or labels.max() >= logits.shape[1]):
            raise ValueError(
                f"CrossEntropyLoss: targets must lie in [0, {logits.shape[1]}), got {labels.min()}..{labels.max()}"
            )
        divisor = self._divisor(len(labels))
        rows = np.arange(len(labels))
        shifted = logits - logits.max(axis=1, keepdims=True) if logits.size else logits
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        grad = np.exp(log_probs)
        grad[rows, labels] -= 1
        grad /= divisor
        self._saved = grad
        return float(-log_probs[rows, labels].sum() / divisor)
