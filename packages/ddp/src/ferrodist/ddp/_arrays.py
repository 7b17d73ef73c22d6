"""The few array operations the communication hooks need, for numpy and for torch.

A hook is written once against ``ArrayOps``; the bucket hands it the implementation that
matches its buffer (numpy for ``ferrodist.nn`` modules, torch for torch modules, on the
CPU or a CUDA device).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ferrodist.core import dtype as _dtype

__all__ = ["ArrayOps", "NumpyOps", "TorchOps"]


class ArrayOps:
    def empty(self, like: Any, numel: int, dtype: str) -> Any:
        raise NotImplementedError

    def cast_scaled(self, dst: Any, src: Any, factor: float) -> None:
        """``dst[:] = src * factor``, cast to dst's dtype."""
        raise NotImplementedError

    def copy(self, dst: Any, src: Any) -> None:
        raise NotImplementedError

    def matmul(self, out: Any, a: Any, b: Any) -> None:
        raise NotImplementedError

    def orthonormalize(self, m: Any) -> None:
        """Make the columns of ``m`` orthonormal, in place (a thin QR's Q)."""
        raise NotImplementedError

    def standard_normal(self, like: Any, shape: tuple[int, int], seed: int) -> Any:
        raise NotImplementedError

    def sub(self, out: Any, a: Any, b: Any) -> None:
        raise NotImplementedError

    def add_(self, dst: Any, src: Any) -> None:
        raise NotImplementedError

    def zero_(self, dst: Any) -> None:
        raise NotImplementedError

    def scale_(self, dst: Any, factor: float) -> None:
        raise NotImplementedError


class NumpyOps(ArrayOps):
    def empty(self, like: Any, numel: int, dtype: str) -> np.ndarray:
        return np.empty(numel, dtype=_dtype(dtype).numpy)

    def cast_scaled(self, dst: Any, src: Any, factor: float) -> None:
        if factor == 1.0:
            np.copyto(dst, src, casting="unsafe")
        else:
            np.multiply(src, np.float32(factor) if src.dtype != np.float64 else factor, out=dst, casting="unsafe")

    def copy(self, dst: Any, src: Any) -> None:
        np.copyto(dst, src, casting="unsafe")

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

    def zero_(self, dst: Any) -> None:
        dst.fill(0)

    def scale_(self, dst: Any, factor: float) -> None:
        np.multiply(dst, factor, out=dst, casting="unsafe")


class TorchOps(ArrayOps):
    def __init__(self) -> None:
        self.torch = sys.modules["torch"]

    def empty(self, like: Any, numel: int, dtype: str) -> Any:
        return self.torch.empty(numel, dtype=getattr(self.torch, dtype), device=like.device)

    def cast_scaled(self, dst: Any, src: Any, factor: float) -> None:
        if dst.dtype == src.dtype or factor == 1.0:
            dst.copy_(src)
            if factor != 1.0:
                dst.mul_(factor)
        else:
            # torch refuses out= of a narrower dtype: scale in src's precision, then cast once.
            dst.copy_(src * factor)

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

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

    def zero_(self, dst: Any) -> None:
        dst.zero_()

    def scale_(self, dst: Any, factor: float) -> None:
        dst.mul_(factor)
