"""One model chunk on one rank, with its micro-batches in flight.

Two kinds of module are adapted for you: a ``ferrodist.nn`` module (explicit
``backward_input`` and ``backward_weight``; each micro-batch's saved state is ``stash()``ed
between actions) and a PyTorch ``nn.Module`` on the CPU or a CUDA device (autograd: B is
``autograd.grad`` on the input, W a backward into the parameters; the graph is kept between
them). Anything else (CuPy, JAX, Numba device code) subclasses ``Stage``. torch is imported
only when given a torch module.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferrodist.core import DType, InvalidArgument, is_torch_module

__all__ = ["KitStage", "Stage", "TorchStage", "adapt_stage"]


class Stage:
    """One chunk of the model as the pipeline drives it: forward, B (gradient of the input),
    W (gradients of the weights) or both, per micro-batch.

    ``Pipeline`` adapts ``ferrodist.nn`` and torch modules itself; subclass this for other
    array libraries. Values are arrays that ``ferrodist.core.as_tensor`` accepts (numpy, a
    Numba device array, anything with ``__cuda_array_interface__`` or DLPack), so device
    arrays travel between ranks through the group's device engine. The defaults below
    are for numpy; a stage whose values live on a GPU overrides ``empty``, ``copy`` and
    ``concat`` (and ``outgoing`` for a dtype conversion).
    """

    kind = "custom"

    def forward(self, mb: int, x: Any, *, keep: bool) -> Any:
        """The chunk's output for micro-batch ``mb``; ``keep``: save what its backward needs."""
        raise NotImplementedError

    def loss(self, mb: int, output: Any, target: Any, loss_fn: Any, weight: float) -> float:
        """Last stage: ``weight`` times the loss of micro-batch ``mb``, keeping what its
        backward starts from."""
        raise NotImplementedError

    def backward_input(self, mb: int, grad: Any) -> Any:
        """B: the gradient of micro-batch ``mb``'s input, given that of its output (None on
        the last stage: start from the loss); keep what W needs."""
        raise NotImplementedError

    def backward_weight(self, mb: int) -> None:
        """W: accumulate micro-batch ``mb``'s weight gradients (after its B)."""
        raise NotImplementedError

    def backward(self, mb: int, grad: Any) -> Any:
        """B and W at once (the fused BW); returns the gradient of the input."""
        gx = self.backward_input(mb, grad)
        self.backward_weight(mb)
        return gx

    def expected_features(self) -> int | None:
        """The width of the input this chunk takes (its first linear layer), if known:
        the pipeline checks the previous stage's header against it."""
        return None

    def clear(self) -> None:
        """Drop every micro-batch in flight (after a failed step)."""

    def outgoing(self, value: Any, dtype: DType | None = None) -> Any:
        """``value`` as a contiguous array to send (converted to ``dtype`` if given)."""
        out = np.ascontiguousarray(value)
        return out if dtype is None else out.astype(dtype.numpy, copy=False)

    def empty(self, shape: tuple[int, ...], dtype: DType) -> Any:
        """A receive buffer where this chunk wants its inputs and output gradients."""
        return np.empty(shape, dtype.numpy)

    def copy(self, value: Any) -> Any:
        """A copy of an outgoing array (a message between two chunks of one rank)."""
        return np.array(value, copy=True)

    def concat(self, parts: list[Any]) -> Any:
        """The outputs of all micro-batches as one batch (``eval_step`` on the last stage)."""
        return np.concatenate(parts)


class KitStage(Stage):
    kind = "ferrodist.nn"

    def __init__(self, module: Any) -> None:
        self.module = module
        self.saved: dict[int, Any] = {}  # micro-batch -> its stash
        self.seeds: dict[int, Any] = {}  # last stage: micro-batch -> gradient of its weighted loss

    def forward(self, mb: int, x: Any, *, keep: bool) -> Any:
        y = self.module(x)
        stash = self.module.stash()  # without keep (inference), dropped
        if keep:
            self.saved[mb] = stash
        return y

    def loss(self, mb: int, output: Any, target: Any, loss_fn: Any, weight: float) -> float:
        value = float(loss_fn(output, target))
        self.seeds[mb] = np.asarray(loss_fn.backward()) * weight
        return value * weight

    def _seed(self, mb: int, grad: Any) -> Any:
        return self.seeds.pop(mb) if grad is None else grad

    def backward_input(self, mb: int, grad: Any) -> Any:
        self.module.restore(self.saved.pop(mb))
        gx = self.module.backward_input(self._seed(mb, grad))
        self.saved[mb] = self.module.stash()
        return gx

    def backward_weight(self, mb: int) -> None:
        self.module.restore(self.saved.pop(mb))
        self.module.backward_weight()

    def backward(self, mb: int, grad: Any) -> Any:
        self.module.restore(self.saved.pop(mb))
        return self.module.backward(self._seed(mb, grad))

    def expected_features(self) -> int | None:
        return _first_width(self.module, kit=True)

    def clear(self) -> None:
        self.saved.clear()
        self.seeds.clear()
        self.module.stash()


class TorchStage(Stage):
    kind = "torch"

    def __init__(self, module: Any) -> None:
        import torch

        self.torch = torch
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.graphs: dict[int, tuple[Any, Any, Any]] = {}  # micro-batch -> (input, root, root's gradient)

    @property
    def device(self) -> Any:
        """Where the module lives (its first parameter or buffer; the CPU without either)."""
        for tensor in self.module.parameters():
            return tensor.device
        for tensor in self.module.buffers():
            return tensor.device
        return self.torch.device("cpu")

    def forward(self, mb: int, x: Any, *, keep: bool) -> Any:
        torch = self.torch
        x = torch.as_tensor(x, device=self.device)
        if not keep:
            with torch.no_grad():
                return self.module(x)
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        y = self.module(x)
        self.graphs[mb] = (x, y, None)
        return y.detach()

    def loss(self, mb: int, output: Any, target: Any, loss_fn: Any, weight: float) -> float:
        x, y, _ = self.graphs[mb]
        value = loss_fn(y, self.torch.as_tensor(target, device=y.device)) * weight
        self.graphs[mb] = (x, value, None)
        return float(value.detach())

    def _root(self, mb: int, grad: Any) -> tuple[Any, Any, Any]:
        x, root, _ = self.graphs.pop(mb)
        seed = None if grad is None else self.torch.as_tensor(grad, device=root.device)
        return x, root, seed

    def backward_input(self, mb: int, grad: Any) -> Any:
        x, root, seed = self._root(mb, grad)
        gx = None
        if x.requires_grad:
            (gx,) = self.torch.autograd.grad(root, [x], seed, retain_graph=True)
        self.graphs[mb] = (x, root, seed)
        return gx

    def backward_weight(self, mb: int) -> None:
        _, root, seed = self.graphs.pop(mb)
        if self.params:
            self.torch.autograd.backward(root, seed, inputs=self.params)

    def backward(self, mb: int, grad: Any) -> Any:
        x, root, seed = self._root(mb, grad)
        inputs = ([x] if x.requires_grad else []) + self.params
        if not inputs:
            return None
        x.grad = None
        self.torch.autograd.backward(root, seed, inputs=inputs)
        return x.grad if x.requires_grad else None

    def expected_features(self) -> int | None:
        return _first_width(self.module, kit=False)

    def clear(self) -> None:
        self.graphs.clear()

    def _dtype(self, dtype: DType) -> Any:
        return getattr(self.torch, dtype.name)  # core's names are torch's (bool, bfloat16, ...)

    def outgoing(self, value: Any, dtype: DType | None = None) -> Any:
        out = value.detach()
        if dtype is not None:
            out = out.to(self._dtype(dtype))
        return out.contiguous()

    def empty(self, shape: tuple[int, ...], dtype: DType) -> Any:
        return self.torch.empty(shape, dtype=self._dtype(dtype), device=self.device)

    def copy(self, value: Any) -> Any:
        return value.clone()

    def concat(self, parts: list[Any]) -> Any:
        return self.torch.cat(parts)


def adapt_stage(module: Any) -> Stage:
    if isinstance(module, Stage):
        return module
    if is_torch_module(module):
        return TorchStage(module)
    for method in ("backward_input", "backward_weight", "stash", "restore", "named_parameters"):
        if not callable(getattr(module, method, None)):
            raise InvalidArgument(
                f"Pipeline: a {type(module).__name__} is neither a ferrodist.nn Module nor a torch.nn.Module "
                f"(it has no {method}()); pass one of those, or a ferrodist.pipeline.Stage, as the stage"
            )
    return KitStage(module)


def _first_width(module: Any, *, kit: bool) -> int | None:
    """in_features of the first layer with parameters, when that layer is a linear one."""
    leaves = (m for m in module.modules() if not list(m.children())) if not kit else _kit_leaves(module)
    for leaf in leaves:
        has_params = any(True for _ in leaf.parameters()) if not kit else bool(list(leaf.named_parameters()))
        if not has_params:
            continue
        width = getattr(leaf, "in_features", None)
        return int(width) if isinstance(width, int) else None
    return None


def _kit_leaves(module: Any) -> Any:
    children = list(module.children())
    if not children:
        yield module
        return
    for child in children:
        yield from _kit_leaves(child)
