"""What every CUDA kernel of ferrodist.gpu shares (private): the launch configuration of a
grid-stride loop, and the device functions (float16/bfloat16 bits to float32 and back,
rounded to nearest-even as the CPU kernels do; one function per reduce op). Built on
first use: ``numba.cuda`` is imported inside functions only."""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np

from ferrodist.core import InvalidArgument
from ferrodist.core.kernels import BAND, BOR, BXOR, MAX, MIN, PRODUCT, SUM

__all__ = [
    "DIVIDE",
    "MAX_ARRAYS_PER_LAUNCH",
    "MAX_BLOCKS",
    "THREADS_PER_BLOCK",
    "halves",
    "launch",
    "launch_config",
    "op_function",
]

#: The opcode of scale's division (core's opcodes are the ReduceOp values).
DIVIDE = 100

#: Default threads per block of every launch.
THREADS_PER_BLOCK = 256
#: Default cap on blocks per launch (about one full wave of 256-thread blocks on a large GPU).
MAX_BLOCKS = 1024
#: Arrays one pack/unpack launch moves: 64 one-dimensional array arguments and the offsets
#: table fit in the 4 KiB of kernel parameters that every CUDA version and GPU accepts.
MAX_ARRAYS_PER_LAUNCH = 64

# ---------------------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------------------


def launch_config(n: int, *, threads: int = THREADS_PER_BLOCK, max_blocks: int = MAX_BLOCKS) -> tuple[int, int]:
    """The grid ``(blocks, threads_per_block)`` for a grid-stride loop over ``n`` elements.

    A block has ``threads`` threads, or fewer for a small ``n`` (rounded up to a whole
    32-thread warp); there are ``ceil(n / threads_per_block)`` blocks, at most
    ``max_blocks`` (the loop then strides). ``n == 0`` gives ``(0, 0)``: launch nothing.

    Example:
        >>> launch_config(10), launch_config(1000), launch_config(10**9)
        ((1, 32), (4, 256), (1024, 256))
    """
    n = operator.index(n)
    if n < 0:
        raise InvalidArgument(f"launch_config: the element count is {n}; it must be >= 0")
    if not 1 <= threads <= 1024:
        raise InvalidArgument(f"launch_config: threads={threads}; CUDA blocks have 1 to 1024 threads")
    if max_blocks < 1:
        raise InvalidArgument(f"launch_config: max_blocks={max_blocks}; it must be >= 1")
    if n == 0:
        return 0, 0
    per_block = min(threads, -(-n // 32) * 32)
    return min(-(-n // per_block), max_blocks), per_block


def launch(kernel: Any, n: int, stream: Any, threads: int, max_blocks: int, *args: Any) -> None:
    blocks, per_block = launch_config(n, threads=threads, max_blocks=max_blocks)
    if blocks:
        kernel[blocks, per_block, 0 if stream is None else stream](*args)


# ---------------------------------------------------------------------------------------
# Device functions (built on first use)
# ---------------------------------------------------------------------------------------


@functools.cache
def halves() -> dict[str, Any]:
    """Device functions: float16/bfloat16 bit patterns to float32 and back (nearest-even).

    Bit casts use scalar ``.view``, which Numba compiles to a register bitcast and the
    simulator runs as numpy. Integers are int64 throughout (numpy and Numba would
    otherwise promote mixed uint32/int64 arithmetic to float64).
    """
    from numba import cuda

    @cuda.jit(device=True)
    def bits_of(x):  # type: ignore[no-untyped-def]
        return np.int64(np.float32(x).view(np.uint32))

    @cuda.jit(device=True)
    def float_of(bits):  # type: ignore[no-untyped-def]
        return np.uint32(bits).view(np.float32)

    @cuda.jit(device=True)
    def bf16_load(h):  # type: ignore[no-untyped-def]
        return float_of(np.int64(h) << 16)

    @cuda.jit(device=True)
    def bf16_store(x):  # type: ignore[no-untyped-def]
        bits = bits_of(x)
        if (bits & 0x7FFFFFFF) > 0x7F800000:  # NaN: truncate, and keep it a quiet NaN
            return np.uint16((bits >> 16) | 0x40)
        return np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)

    @cuda.jit(device=True)
    def f16_load(h):  # type: ignore[no-untyped-def]
        # Move exponent and mantissa to float32 positions, then rebias the exponent.
        body = (np.int64(h) & 0x7FFF) << 13
        exponent = body & 0x0F800000
        body += (127 - 15) << 23
        if exponent == 0x0F800000:  # inf / nan
            value = float_of(body + ((128 - 16) << 23))
        elif exponent == 0:  # zero / subnormal: renormalise with an exact float32 subtraction
            value = float_of(body + (1 << 23)) - float_of(113 << 23)
        else:
            value = float_of(body)
        if np.int64(h) & 0x8000:
            return -value
        return value

    @cuda.jit(device=True)
    def f16_store(x):  # type: ignore[no-untyped-def]
        bits = bits_of(x)
        sign = (bits >> 16) & 0x8000
        mag = bits & 0x7FFFFFFF
        if mag >= (127 + 16) << 23:  # overflows float16, or inf / nan
            out = 0x7E00 if mag > 0x7F800000 else 0x7C00
        elif mag < 113 << 23:  # a float16 subnormal or zero: let a float32 addition round it
            magic = ((127 - 15) + (23 - 10) + 1) << 23
            out = bits_of(float_of(mag) + float_of(magic)) - magic
        else:  # normal: rebias the exponent, round the mantissa to nearest-even
            out = (mag + ((15 - 127) << 23) + 0xFFF + ((mag >> 13) & 1)) >> 13
        return np.uint16(out | sign)

    return {
        "bits_of": bits_of,
        "float_of": float_of,
        "bf16_load": bf16_load,
        "bf16_store": bf16_store,
        "f16_load": f16_load,
        "f16_store": f16_store,
    }


@functools.cache
def op_function(opcode: int) -> Any:
    """The device function ``f(a, b)`` of one op (MIN/MAX propagate NaN like numpy)."""
    from numba import cuda

    def add(a, b):  # type: ignore[no-untyped-def]
        return a + b

    def multiply(a, b):  # type: ignore[no-untyped-def]
        return a * b

    def divide(a, b):  # type: ignore[no-untyped-def]
        return a / b

    def minimum(a, b):  # type: ignore[no-untyped-def]
        return a if (a <= b or a != a) else b

    def maximum(a, b):  # type: ignore[no-untyped-def]
        return a if (a >= b or a != a) else b

    def bit_and(a, b):  # type: ignore[no-untyped-def]
        return a & b

    def bit_or(a, b):  # type: ignore[no-untyped-def]
        return a | b

    def bit_xor(a, b):  # type: ignore[no-untyped-def]
        return a ^ b

    table = {
        SUM: add,
        PRODUCT: multiply,
        DIVIDE: divide,
        MIN: minimum,
        MAX: maximum,
        BAND: bit_and,
        BOR: bit_or,
        BXOR: bit_xor,
    }
    return cuda.jit(device=True)(table[opcode])
