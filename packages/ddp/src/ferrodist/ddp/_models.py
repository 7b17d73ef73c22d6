"""The two kinds of module DDP wraps, behind one small interface.

``ferrodist.nn`` modules (numpy, explicit backward) and PyTorch ``nn.Module``s differ in
how gradients are stored, announced and finished; everything else in this package talks
to a ``Model``. Foreign objects are inspected here and nowhere else. torch is imported
only when the caller hands us a torch module (it is then already imported).
"""

from __future__ import annotations

import abc
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import numpy as np

from ferrodist.collectives import shared_zeros
from ferrodist.core import InvalidArgument, is_torch_module
from ferrodist.core import dtype as _dtype

from ._buckets import ParamSpec

__all__ = ["KitModel", "Model", "TorchModel", "adapt"]


class Model(abc.ABC):
    """What DDP needs of a module: its trainable parameters and buffers, flat buffers of
    the right kind, gradients as views into them, and a call when each gradient is final."""

    kind = "abstract"
    #: Where the end of a backward comes from: ``True``, the framework's autograd (DDP
    #: finishes the step when it ends); ``False``, an explicit ``DDP.backward`` call.
    autograd = False
    #: A missing gradient arrives in a fresh array of the framework's (PyTorch): copying it
    #: into the bucket once is cheaper than a zeroed view plus an in-place addition.
    fresh_gradients = False

    def __init__(self, module: Any) -> None:
        self.module = module
        self.names: list[str] = []
        self.params: list[Any] = []

    # -- description -------------------------------------------------------------------
    @abc.abstractmethod
    def specs(self) -> list[ParamSpec]:
        """The trainable parameters' names, shapes, dtypes and devices, in order."""

    @abc.abstractmethod
    def state(self) -> Iterator[tuple[str, Any]]:
        """Every parameter and buffer (name, array), in a fixed order, for the first broadcast."""

    # -- flat buffers and gradient views ----------------------------------------------------
    @abc.abstractmethod
    def flat(self, dtype: str, device: str, numel: int) -> Any:
        """A zeroed flat buffer of ``numel`` elements of ``dtype`` on ``device``."""

    def shared_flat(self, dtype: str, numel: int, group: Any) -> Any:
        """A zeroed flat host buffer in the memory ``group``'s ranks share (``shared_zeros``),
        which its all_reduce reads in place; an ordinary one where they share none. A
        collective: every rank makes its buckets' buffers in the same order."""
        return shared_zeros(numel, dtype, group)

    @abc.abstractmethod
    def view(self, flat: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        """The ``numel`` elements of ``flat`` from ``offset``, as an array of ``shape`` (no copy)."""

    @abc.abstractmethod
    def grad(self, i: int) -> Any:
        """Parameter i's gradient (None before its first backward)."""

    @abc.abstractmethod
    def set_grad(self, i: int, value: Any) -> None:
        """Make ``value`` parameter i's gradient."""

    @abc.abstractmethod
    def is_view(self, grad: Any, view: Any) -> bool:
        """Whether ``grad`` is ``view`` (the bucket's view of that parameter's gradient)."""

    def adoptable(self, grad: Any, view: Any) -> Any:
        """``grad`` flattened, when a bucket of this one parameter may average ``grad`` where
        it is instead of a copy in the bucket (a fresh gradient that nothing else holds,
        laid out like ``view``); else None. The kit's gradients are always copied."""
        return None

    @abc.abstractmethod
    def copy(self, dst: Any, src: Any) -> None:
        """``dst[:] = src``."""

    @abc.abstractmethod
    def zero_(self, array: Any) -> None:
        """``array[:] = 0``."""

    @abc.abstractmethod
    def hook(self, i: int, fn: Callable[[int], None]) -> Any:
        """Call ``fn(i)`` each time parameter i's gradient has been accumulated; returns a handle."""

    @abc.abstractmethod
    def at_end_of_backward(self, fn: Callable[[], None]) -> None:
        """Arrange for ``fn`` to run when the backward now running ends (torch only)."""

    @abc.abstractmethod
    def numpy(self, array: Any) -> np.ndarray:
        """A host numpy view (or copy, for device arrays) of ``array``, for checks and stats."""

    @abc.abstractmethod
    def small(self, array: np.ndarray) -> Any:
        """``array`` (a few bytes of bookkeeping) as an array the group takes: on the
        parameters' device for torch modules, so an NCCL group can carry it."""

    # -- array operations (the communication hooks') ---------------------------------------
    @abc.abstractmethod
    def empty(self, like: Any, numel: int, dtype: str) -> Any:
        """A new flat array of ``numel`` elements of ``dtype``, where ``like`` lives."""

    @abc.abstractmethod
    def matmul(self, out: Any, a: Any, b: Any) -> None:
        """``out = a @ b``."""

    @abc.abstractmethod
    def orthonormalize(self, m: Any) -> None:
        """Make the columns of ``m`` orthonormal, in place (a thin QR's Q)."""

    @abc.abstractmethod
    def standard_normal(self, like: Any, shape: tuple[int, int], seed: int) -> Any:
        """A ``shape`` array of standard normal values from ``seed``, like ``like``."""

    @abc.abstractmethod
    def sub(self, out: Any, a: Any, b: Any) -> None:
        """``out = a - b``."""

    @abc.abstractmethod
    def add_(self, dst: Any, src: Any) -> None:
        """``dst += src``."""

    @abc.abstractmethod
    def scale_(self, dst: Any, factor: float) -> None:
        """``dst *= factor``."""

    @abc.abstractmethod
    def save(self, state: Any, file: BinaryIO) -> None:
        """Write a checkpoint's ``state`` to ``file`` in this framework's format."""

    @abc.abstractmethod
    def load(self, file: BinaryIO, map_location: Any = None) -> Any:
        """Read a checkpoint's state from ``file``."""


class KitModel(Model):
    """A ``ferrodist.nn`` module: numpy arrays, gradients announced by the kit's hooks."""

    kind = "ferrodist.nn"

    def __init__(self, module: Any) -> None:
        super().__init__(module)
        for name, p in module.named_parameters():
            self.names.append(name)
            self.params.append(p)

    def specs(self) -> list[ParamSpec]:
        return [
            ParamSpec(n, tuple(p.data.shape), p.data.dtype.name, p.data.dtype.itemsize)
            for n, p in zip(self.names, self.params, strict=True)
        ]

    def state(self) -> Iterator[tuple[str, Any]]:
        yield from ((n, p.data) for n, p in zip(self.names, self.params, strict=True))
        yield from self.module.named_buffers()

    def flat(self, dtype: str, device: str, numel: int) -> np.ndarray:
        return np.zeros(numel, dtype=dtype)

    def view(self, flat: np.ndarray, offset: int, numel: int, shape: tuple[int, ...]) -> np.ndarray:
        return flat[offset : offset + numel].reshape(shape)

    def grad(self, i: int) -> Any:
        return self.params[i].grad

    def set_grad(self, i: int, value: Any) -> None:
        self.params[i].grad = value

    def is_view(self, grad: Any, view: Any) -> bool:
        return grad is view

    def copy(self, dst: Any, src: Any) -> None:
        np.copyto(dst, src)

    def zero_(self, array: Any) -> None:
        array.fill(0)

    def hook(self, i: int, fn: Callable[[int], None]) -> Any:
        return self.params[i].register_post_accumulate_grad_hook(lambda _p: fn(i))

    def at_end_of_backward(self, fn: Callable[[], None]) -> None:
        raise AssertionError("ferrodist.nn backward is driven by DistributedDataParallel.backward")

    def numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def small(self, array: np.ndarray) -> np.ndarray:
        return array

    def empty(self, like: Any, numel: int, dtype: str) -> np.ndarray:
        return np.empty(numel, dtype=_dtype(dtype).numpy)

    def matmul(self, out: Any, a: Any, b: Any) -> None:
        np.matmul(a, b, out=out)

    def orthonormalize(self, m: Any) -> None:
        q, _ = np.linalg.qr(m)
        m[...] = q

    def standard_normal(self, like: Any, shape: tuple[int, int], seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(shape).astype(like.dtype)

    def sub(self, out: Any, a: Any, b: Any) -> None:
        np.subtract(a, b, out=out)

    def add_(self, dst: Any, src: Any) -> None:
        np.add(dst, src, out=dst)

    def scale_(self, dst: Any, factor: float) -> None:
        np.multiply(dst, factor, out=dst, casting="unsafe")

    def save(self, state: Any, file: BinaryIO) -> None:
        pickle.dump(state, file, protocol=pickle.HIGHEST_PROTOCOL)

    def load(self, file: BinaryIO, map_location: Any = None) -> Any:
        return pickle.load(file)


class TorchModel(Model):
    """A PyTorch ``nn.Module``: gradients announced by post-accumulate-grad hooks, the end
    of backward by a callback queued on autograd's engine."""

    kind = "torch"
    autograd = True
    fresh_gradients = True

    def __init__(self, module: Any) -> None:
        super().__init__(module)
        self.torch = sys.modules["torch"]
        for name, p in module.named_parameters():
            if p.requires_grad:
                self.names.append(name)
                self.params.append(p)

    def specs(self) -> list[ParamSpec]:
        out = []
        for n, p in zip(self.names, self.params, strict=True):
            dtype = str(p.dtype).removeprefix("torch.")
            device = "cpu" if p.device.type == "cpu" else str(p.device)
            out.append(ParamSpec(n, tuple(p.shape), dtype, p.element_size(), device))
        return out

    def state(self) -> Iterator[tuple[str, Any]]:
        for name, p in self.module.named_parameters():
            yield name, p.data
        for name, b in self.module.named_buffers():
            yield name, b.data

    def flat(self, dtype: str, device: str, numel: int) -> Any:
        return self.torch.zeros(numel, dtype=getattr(self.torch, dtype), device=device)

    def shared_flat(self, dtype: str, numel: int, group: Any) -> Any:
        kind = getattr(self.torch, dtype)
        raw = shared_zeros(numel * kind.itemsize, "uint8", group)  # torch has no numpy bfloat16
        return self.torch.from_numpy(raw).view(kind)

    def view(self, flat: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        return flat[offset : offset + numel].view(shape)

    def grad(self, i: int) -> Any:
        return self.params[i].grad

    def set_grad(self, i: int, value: Any) -> None:
        self.params[i].grad = value

    def is_view(self, grad: Any, view: Any) -> bool:
        return grad is view or (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape)

    def adoptable(self, grad: Any, view: Any) -> Any:
        # autograd's accumulation hands over a gradient it made (or stole: then no one else
        # held it), so averaging it in place touches nothing but this parameter's gradient.
        if (
            grad.layout != self.torch.strided
            or grad.dtype != view.dtype
            or grad.device != view.device
            or grad.shape != view.shape
            or not grad.is_contiguous()
            or grad.requires_grad
        ):
            return None
        return grad.view(-1)

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def zero_(self, array: Any) -> None:
        array.zero_()

    def hook(self, i: int, fn: Callable[[int], None]) -> Any:
        return self.params[i].register_post_accumulate_grad_hook(lambda _p: fn(i))

    def at_end_of_backward(self, fn: Callable[[], None]) -> None:
        self.torch.autograd.Variable._execution_engine.queue_callback(fn)

    def numpy(self, array: Any) -> np.ndarray:
        return array.detach().cpu().numpy()

    def small(self, array: np.ndarray) -> Any:
        device = self.params[0].device if self.params else "cpu"
        return self.torch.from_numpy(array).to(device)

    def empty(self, like: Any, numel: int, dtype: str) -> Any:
        return self.torch.empty(numel, dtype=getattr(self.torch, dtype), device=like.device)

    def matmul(self, out: Any, a: Any, b: Any) -> None:
        self.torch.matmul(a, b, out=out)

    def orthonormalize(self, m: Any) -> None:
        q, _ = self.torch.linalg.qr(m)
        m.copy_(q)

    def standard_normal(self, like: Any, shape: tuple[int, int], seed: int) -> Any:
        gen = self.torch.Generator(device="cpu").manual_seed(seed)
        return self.torch.randn(shape, generator=gen, dtype=like.dtype).to(like.device)

    def sub(self, out: Any, a: Any, b: Any) -> None:
        self.torch.sub(a, b, out=out)

    def add_(self, dst: Any, src: Any) -> None:
        dst.add_(src)

    def scale_(self, dst: Any, factor: float) -> None:
        dst.mul_(factor)

    def save(self, state: Any, file: BinaryIO) -> None:
        self.torch.save(state, file)

    def load(self, file: BinaryIO, map_location: Any = None) -> Any:
        return self.torch.load(file, map_location=map_location, weights_only=False)


def adapt(module: Any) -> Model:
    """The ``Model`` for a ``ferrodist.nn`` module or a PyTorch ``nn.Module``."""
    if is_torch_module(module):
        return TorchModel(module)
    named = getattr(module, "named_parameters", None)
    if named is None or not callable(getattr(module, "backward", None)):
        raise InvalidArgument(
            f"DistributedDataParallel: a {type(module).__name__} is neither a ferrodist.nn Module nor a "
            "torch.nn.Module; wrap one of those"
        )
    model = KitModel(module)
    for name, p in zip(model.names, model.params, strict=True):
        if not isinstance(p.data, np.ndarray):
            raise InvalidArgument(
                f"DistributedDataParallel: parameter {name!r} holds a {type(p.data).__name__}, not a numpy array"
            )
    return model
