"""Optimizers with PyTorch's update rules: SGD (momentum, weight decay) and Adam."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

from ._parameter import Array, Parameter

__all__ = ["SGD", "Adam", "Optimizer"]


def _number(owner: str, name: str, value: object, *, upper: float | None = None) -> float:
    """``value`` as a float in ``[0, upper)`` (``[0, inf)`` without ``upper``), else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{owner}: {name} must be a number, got {value!r}")
    number = float(value)
    if not (0.0 <= number < (math.inf if upper is None else upper)):
        bound = "a finite number >= 0" if upper is None else f"in [0, {upper})"
        raise ValueError(f"{owner}: {name} must be {bound}, got {value!r}")
    return number


class Optimizer:
    """Base class: one list of parameters, per-parameter state, ``step`` and ``zero_grad``.

    Parameters whose ``.grad`` is ``None`` are skipped by ``step`` (their state does not
    advance), as in PyTorch. ``state_dict`` follows PyTorch's layout: ``{"state": {index:
    {...}}, "param_groups": [{hyperparameters..., "params": [0, 1, ...]}]}`` with copied arrays.
    """

    #: per-parameter state: key -> "array" (shaped like the parameter) or "int"
    _state_kinds: ClassVar[dict[str, str]] = {}

    def __init__(self, params: Iterable[Parameter], hyper: dict[str, Any]) -> None:
        params = list(params)
        name = type(self).__name__
        if not params:
            raise ValueError(f"{name}: got an empty parameter list")
        for index, param in enumerate(params):
            if not isinstance(param, Parameter):
                raise TypeError(f"{name}: parameter {index} is a {type(param).__name__}, not a Parameter")
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"{name}: a parameter appears more than once in the list")
        self.params: list[Parameter] = params
        self.state: dict[int, dict[str, Any]] = {}
        self._set_hyper(hyper)

    def _set_hyper(self, hyper: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _hyper(self) -> dict[str, Any]:
        raise NotImplementedError

    def step(self) -> None:
        """Update every parameter that has a gradient, in place (``.data`` stays the same array)."""
        self._set_hyper(self._hyper())  # re-validate: a schedule may have changed lr
        for index, param in enumerate(self.params):
            if param.grad is not None:
                self._update(param.data, param.grad, self.state.setdefault(index, {}))

    def _update(self, data: Array, grad: Array, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every gradient in place (views stay views), or set them to ``None``."""
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.fill(0)

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters and per-parameter state (step counts, buffers), copied."""
        state = {
            index: {key: value.copy() if isinstance(value, np.ndarray) else value for key, value in entry.items()}
            for index, entry in self.state.items()
            if entry
        }
        return {"state": state, "param_groups": [{**self._hyper(), "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace hyperparameters and state with copies of ``state_dict``'s (checked first).

        Raises:
            ValueError: the dictionary is for another number of parameters, or an entry is
                missing, unexpected or of the wrong shape.
        """
        name = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError(f"{name}: expected a dict with keys 'state' and 'param_groups'")
        groups = state_dict["param_groups"]
        if len(groups) != 1 or list(groups[0].get("params", ())) != list(range(len(self.params))):
            raise ValueError(
                f"{name}: the state dict is not for one group of this optimizer's {len(self.params)} parameters"
            )
        hyper = {key: value for key, value in groups[0].items() if key != "params"}
        if set(hyper) != set(self._hyper()):
            raise ValueError(f"{name}: hyperparameters {sorted(hyper)}, expected {sorted(self._hyper())}")
        loaded: dict[int, dict[str, Any]] = {}
        for index, entry in state_dict["state"].items():
            if not isinstance(index, int) or not 0 <= index < len(self.params):
                raise ValueError(f"{name}: state for parameter {index!r}, this optimizer has {len(self.params)}")
            if set(entry) != set(self._state_kinds):
                raise ValueError(
                    f"{name}: parameter {index} has state {sorted(entry)}, expected {sorted(self._state_kinds)}"
                )
            loaded[index] = {key: self._check_state(name, index, key, entry[key]) for key in self._state_kinds}
        self._set_hyper(hyper)  # validates; nothing was changed if it raises
        self.state = loaded

    def _check_state(self, name: str, index: int, key: str, value: Any) -> Any:
        param = self.params[index]
        if self._state_kinds[key] == "int":
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name}: parameter {index}: {key} must be an integer >= 0, got {value!r}")
            return int(value)
        array = np.asarray(value)
        if array.shape != param.shape:
            raise ValueError(f"{name}: parameter {index}: {key} has shape {array.shape}, the parameter {param.shape}")
        return np.array(array, dtype=param.dtype)  # a copy

    def __repr__(self) -> str:
        hyper = ", ".join(f"{key}={value!r}" for key, value in self._hyper().items())
        return f"{type(self).__name__}({len(self.params)} parameters, {hyper})"


class SGD(Optimizer):
    """Stochastic gradient descent with PyTorch's rule (no dampening, no Nesterov).

    Per parameter: ``g = grad + weight_decay * p``; with momentum, ``buf = g`` on its first
    step, else ``buf = momentum * buf + g``, and ``g = buf``; then ``p -= lr * g``.
    ``.grad`` is never modified.

    Args:
        params: the parameters to update (e.g. ``model.parameters()``).
        lr: learning rate, >= 0.
        momentum: momentum factor, >= 0.
        weight_decay: L2 penalty, >= 0.

    Example:
        >>> p = Parameter(np.array([1.0]))
        >>> p.grad = np.array([0.5])
        >>> SGD([p], lr=0.1).step()
        >>> p.data
        array([0.95])
    """

    _state_kinds: ClassVar[dict[str, str]] = {"momentum_buffer": "array"}

    def __init__(
        self, params: Iterable[Parameter], lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    def _set_hyper(self, hyper: Mapping[str, Any]) -> None:
        lr, momentum, weight_decay = (_number("SGD", key, hyper[key]) for key in ("lr", "momentum", "weight_decay"))
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay

    def _hyper(self) -> dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}

    def _update(self, data: Array, grad: Array, state: dict[str, Any]) -> None:
        g = grad + self.weight_decay * data if self.weight_decay else grad
        if self.momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = np.array(g, dtype=data.dtype)
            else:
                buf *= self.momentum
                buf += g
            g = buf
        data -= self.lr * g


class Adam(Optimizer):
    """Adam with PyTorch's rule (bias-corrected moments, L2 weight decay added to the gradient).

    Per parameter, at its step ``t`` (counted per parameter): ``g = grad + weight_decay * p``;
    ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g**2``;
    ``p -= lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)``.

    Args:
        params: the parameters to update.
        lr: learning rate, >= 0.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 penalty, >= 0.

    Example:
        >>> p = Parameter(np.array([1.0]))
        >>> p.grad = np.array([3.0])
        >>> Adam([p], lr=0.1).step()        # the first step moves by about lr
        >>> p.data
        array([0.9])
    """

    _state_kinds: ClassVar[dict[str, str]] = {"step": "int", "exp_avg": "array", "exp_avg_sq": "array"}

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _set_hyper(self, hyper: Mapping[str, Any]) -> None:
        betas = hyper["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Adam: betas must be a pair (beta1, beta2), got {betas!r}")
        beta1, beta2 = (_number("Adam", f"betas[{i}]", b, upper=1.0) for i, b in enumerate(betas))
        lr, eps, weight_decay = (_number("Adam", key, hyper[key]) for key in ("lr", "eps", "weight_decay"))
        self.lr, self.betas, self.eps, self.weight_decay = lr, (beta1, beta2), eps, weight_decay

    def _hyper(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}

    def _update(self, data: Array, grad: Array, state: dict[str, Any]) -> None:
        beta1, beta2 = self.betas
        if not state:
            state.update(step=0, exp_avg=np.zeros_like(data), exp_avg_sq=np.zeros_like(data))
        state["step"] += 1
        step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        g = grad + self.weight_decay * data if self.weight_decay else grad
        m *= beta1
        m += (1 - beta1) * g
        v *= beta2
        v += (1 - beta2) * (g * g)
        denom = np.sqrt(v) / math.sqrt(1 - beta2**step) + self.eps
        data -= (self.lr / (1 - beta1**step)) * (m / denom)
