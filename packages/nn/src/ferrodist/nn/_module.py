"""The Module base class: registration, the explicit and split backward protocol, stash/restore."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._parameter import Array, Parameter

__all__ = ["Module"]


@dataclass(eq=False)
class _Stash:
    """What ``stash()`` returns: one object's saved forward and pending weight-gradient inputs."""

    owner: _Stateful
    saved: Any
    pending: list[Any]
    children: tuple[_Stash, ...]
    restored: bool = field(default=False)


class _Stateful:
    """The per-micro-batch state shared by modules and losses, and its stash/restore.

    ``_saved`` holds what the last forward kept for the backward (``None`` when there is
    none); ``_pending`` lists what ``backward_input`` left for ``backward_weight``.
    """

    _saved: Any
    _pending: list[Any]

    def _state_children(self) -> tuple[_Stateful, ...]:
        return ()

    def _has_state(self) -> bool:
        return self._saved is not None or bool(self._pending) or any(c._has_state() for c in self._state_children())

    def _take_saved(self, operation: str) -> Any:
        """The saved forward, which the caller consumes; a clear error when there is none."""
        if self._saved is None:
            raise RuntimeError(
                f"{type(self).__name__}.{operation}: no saved forward to differentiate; run a forward first "
                "(each forward allows one backward), or restore() the micro-batch that was stash()ed"
            )
        saved, self._saved = self._saved, None
        return saved

    def stash(self) -> _Stash:
        """Take this object's saved state (recursively for children) and leave it empty.

        The state is the activations of the last forward and any weight-gradient inputs that
        ``backward_input`` left pending. It lets several micro-batches be in flight:

            >>> y0 = model(x0); c0 = model.stash()
            >>> y1 = model(x1); c1 = model.stash()
            >>> model.restore(c0); gx0 = model.backward_input(g0); c0 = model.stash()
            >>> model.restore(c1); gx1 = model.backward(g1)
            >>> model.restore(c0); model.backward_weight()

        Returns:
            An opaque context for :meth:`restore` on this same object, usable once.
        """
        ctx = _Stash(self, self._saved, self._pending, tuple(c.stash() for c in self._state_children()))
        self._saved = None
        self._pending = []
        return ctx

    def restore(self, ctx: _Stash) -> None:
        """Put back the state that :meth:`stash` took from this object.

        Raises:
            ValueError: ``ctx`` is not a context stashed from this object.
            RuntimeError: ``ctx`` was restored before (its gradients would count twice), or
                this object holds state of its own (``stash()`` it first, or drop it that way).
        """
        if not isinstance(ctx, _Stash) or ctx.owner is not self:
            raise ValueError(f"{type(self).__name__}.restore: the context was not stash()ed from this object")
        if ctx.restored:
            raise RuntimeError(f"{type(self).__name__}.restore: this context was restored before; stash() again")
        if self._has_state():
            raise RuntimeError(
                f"{type(self).__name__}.restore: this object still holds a forward or pending weight "
                "gradients; stash() them first (and drop the result to discard them)"
            )
        self._check_tree(ctx)
        self._put(ctx)

    def _check_tree(self, ctx: _Stash) -> None:
        children = self._state_children()
        if len(children) != len(ctx.children) or any(
            s.owner is not c for c, s in zip(children, ctx.children, strict=True)
        ):
            raise ValueError(f"{type(self).__name__}.restore: the children changed since stash()")
        for child, sub in zip(children, ctx.children, strict=True):
            child._check_tree(sub)

    def _put(self, ctx: _Stash) -> None:
        ctx.restored = True
        self._saved = ctx.saved
        self._pending = ctx.pending
        for child, sub in zip(self._state_children(), ctx.children, strict=True):
            child._put(sub)


class Module(_Stateful):
    """Base class of the kit's layers: parameters, children, and an explicit backward.

    A subclass calls ``super().__init__()`` first, then assigns its :class:`Parameter` and
    child ``Module`` attributes (they are registered in assignment order), and implements

    - ``forward(x)``: computes the output and keeps what the backward needs in ``self._saved``;
    - ``backward_input(g)``: takes ``self._take_saved(...)``, returns the input gradient and
      appends what the weight gradient needs to ``self._pending``;
    - ``backward_weight()``: takes ``self._pending`` and calls ``accumulate_grad`` on each
      parameter once, when its gradient is final (this fires the parameter's hooks).

    ``backward(g)`` is ``backward_input(g)`` then ``backward_weight()``. The default
    ``backward_weight`` runs the children's in reverse, so a module without parameters of
    its own needs only ``forward`` and ``backward_input``.

    Example:
        >>> model = Sequential(Linear(3, 4, rng=0), Tanh(), Linear(4, 1, rng=1))
        >>> y = model(np.ones((2, 3)))
        >>> gx = model.backward(np.ones((2, 1)))   # accumulates every parameter's .grad
        >>> [name for name, _ in model.named_parameters()]
        ['0.weight', '0.bias', '2.weight', '2.bias']
    """

    training: bool
    _parameters: dict[str, Parameter]
    _buffers: dict[str, Array]
    _modules: dict[str, Module]

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})
        self.training = True
        self._saved = None
        self._pending = []

    def __setattr__(self, name: str, value: object) -> None:
        registries: tuple[dict[str, Any], ...] = (self._registry("_parameters"), self._registry("_modules"))
        for registry in registries:
            registry.pop(name, None)
        if isinstance(value, Parameter):
            registries[0][name] = value
        elif isinstance(value, Module):
            registries[1][name] = value
        buffers = self._registry("_buffers")
        if name in buffers:  # assigning to a buffer's name replaces it, or unregisters it
            if isinstance(value, np.ndarray):
                buffers[name] = value
            else:
                del buffers[name]
        object.__setattr__(self, name, value)

    def _registry(self, which: str) -> dict[str, Any]:
        try:
            registry: dict[str, Any] = object.__getattribute__(self, which)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__}: call super().__init__() before assigning attributes"
            ) from None
        return registry

    def register_buffer(self, name: str, array: Array) -> None:
        """Register a non-trainable array (saved in ``state_dict``, reachable as an attribute)."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"register_buffer({name!r}): needs a numpy array, got {type(array).__name__}")
        self._registry("_buffers")[name] = array
        object.__setattr__(self, name, array)

    # --- the backward protocol -------------------------------------------------------------

    def __call__(self, x: Array) -> Array:
        return self.forward(x)

    def forward(self, x: Array) -> Array:
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def backward(self, grad_output: Array) -> Array:
        """Gradient of the input; accumulates every parameter's gradient (hooks fire as each is final).

        Raises:
            RuntimeError: there is no saved forward (none ran, or its backward already did).
        """
        grad_input = self.backward_input(grad_output)
        self.backward_weight()
        return grad_input

    def backward_input(self, grad_output: Array) -> Array:
        """Only the input gradient; what the weight gradients need stays pending."""
        raise NotImplementedError(f"{type(self).__name__} does not implement backward_input")

    def backward_weight(self) -> None:
        """Compute and accumulate the pending weight gradients (a no-op without parameters)."""
        for child in reversed(self._state_children()):
            child.backward_weight()

    def _state_children(self) -> tuple[Module, ...]:
        return tuple(self._modules.values())

    def children(self) -> Iterator[Module]:
        """The modules registered directly on this one, in registration order (as PyTorch)."""
        return iter(tuple(self._modules.values()))

    def modules(self) -> Iterator[Module]:
        """This module, then every module below it, depth first in registration order."""
        yield self
        for child in self._modules.values():
            yield from child.modules()

    # --- parameters, modes and state ---------------------------------------------------------

    def named_parameters(self, prefix: str = "") -> list[tuple[str, Parameter]]:
        """``(dotted name, parameter)``: this module's own in registration order, then each child's
        (recursively, in registration order), each parameter once (as PyTorch)."""
        seen: set[int] = set()
        out: list[tuple[str, Parameter]] = []
        for name, param in self._walk("_parameters", prefix):
            if id(param) not in seen:
                seen.add(id(param))
                out.append((name, param))
        return out

    def parameters(self) -> list[Parameter]:
        """The parameters in the order of :meth:`named_parameters`, each once."""
        return [param for _, param in self.named_parameters()]

    def named_buffers(self, prefix: str = "") -> list[tuple[str, Array]]:
        """``(dotted name, array)`` of the registered buffers (the kit's own layers have none)."""
        return list(self._walk("_buffers", prefix))

    def buffers(self) -> list[Array]:
        return [array for _, array in self.named_buffers()]

    def _walk(self, which: str, prefix: str) -> Iterator[tuple[str, Any]]:
        for name, value in self._registry(which).items():
            yield prefix + name, value
        for name, child in self._modules.items():
            yield from child._walk(which, f"{prefix}{name}.")

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every gradient in place (views stay views), or set them to ``None``."""
        for param in self.parameters():
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.fill(0)

    def train(self, mode: bool = True) -> Module:
        """Set ``training`` on this module and its children; returns ``self``."""
        self.training = bool(mode)
        for child in self._modules.values():
            child.train(mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def state_dict(self) -> dict[str, Array]:
        """Copies of the parameters' and buffers' arrays, by dotted name."""
        out = {name: param.data.copy() for name, param in self.named_parameters()}
        out.update((name, array.copy()) for name, array in self.named_buffers())
        return out

    def load_state_dict(self, state: Mapping[str, Array]) -> None:
        """Copy ``state`` into the existing arrays in place (all checked before anything is written).

        Raises:
            ValueError: keys are missing or unexpected, or an array's shape differs.
            TypeError: a value is not array-like or cannot be cast to the target's dtype.
        """
        targets = {name: param.data for name, param in self.named_parameters()}
        targets.update(self.named_buffers())
        missing = sorted(set(targets) - set(state))
        unexpected = sorted(set(state) - set(targets))
        problems: list[str] = []
        if missing:
            problems.append(f"missing keys {missing}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected}")
        sources: dict[str, Array] = {}
        for name in targets.keys() & state.keys():
            source = np.asarray(state[name])
            if source.shape != targets[name].shape:
                problems.append(f"{name!r} has shape {source.shape}, the model's is {targets[name].shape}")
            elif not np.can_cast(source.dtype, targets[name].dtype, casting="same_kind"):
                raise TypeError(
                    f"load_state_dict: {name!r} of dtype {source.dtype} cannot become {targets[name].dtype}"
                )
            sources[name] = source
        if problems:
            raise ValueError(f"{type(self).__name__}.load_state_dict: " + "; ".join(problems))
        for name, source in sources.items():
            np.copyto(targets[name], source, casting="same_kind")

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        if not self._modules:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"  ({name}): " + repr(child).replace("\n", "\n  ") for name, child in self._modules.items()]
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"
