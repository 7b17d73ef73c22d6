"""float32 arrays to bfloat16 bits and back, on the host: the compiled loops of
``_kernels`` where they are loaded, numpy (the same bits) while they compile."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ._compile.twin import Twin
from ._dtypes import bfloat16
from ._interpreted import bf16_narrow, bf16_widen

Array = np.ndarray[Any, Any]

__all__ = ["cast_twins", "from_bfloat16", "through_bfloat16", "to_bfloat16"]


def to_bfloat16(dst: Array, src: Array) -> None:
    """``dst`` (uint16, flat) = the bfloat16 bits of ``src`` (float32, flat, as long),
    rounded to nearest-even; a NaN stays a quiet NaN."""
    cast_twins()[0](dst, src)


def from_bfloat16(dst: Array, src: Array) -> None:
    """``dst`` (float32, flat) = the values of the bfloat16 bits ``src`` (uint16, flat, as
    long), exactly."""
    cast_twins()[1](dst, src)


def through_bfloat16(x: Array, run: Callable[[Array], None]) -> None:
    """``run(bits)`` on the bfloat16 rounding of the flat float32 array ``x`` (``bits``: a new
    array of ml_dtypes' bfloat16), then ``x`` = the widened ``bits`` that ``run`` left."""
    bits = np.empty(x.shape[0], bfloat16.numpy)
    to_bfloat16(bits.view(np.uint16), x)
    run(bits)
    from_bfloat16(x, bits.view(np.uint16))


@functools.cache
def cast_twins() -> tuple[Twin, Twin]:
    """The twins behind ``to_bfloat16`` and ``from_bfloat16``, made at their first use."""
    from ._kernels import bf16_to_f32, f32_to_bf16

    def narrow_into(dst: Array, src: Array) -> None:
        dst[...] = bf16_narrow(src)

    def widen_into(dst: Array, src: Array) -> None:
        dst[...] = bf16_widen(src)

    return Twin(f32_to_bf16, narrow_into), Twin(bf16_to_f32, widen_into)
