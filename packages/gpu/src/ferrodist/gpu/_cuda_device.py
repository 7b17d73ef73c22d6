"""What every CUDA kernel of ferrodist.gpu shares (private): the launch configuration of a
grid-stride loop, how a kernel function is compiled (:func:`jit_kernel`), and the device
functions (float16/bfloat16 bits to float32 and back, rounded to nearest-even as the CPU
kernels do; one function per reduce op). Built on first use: ``numba.cuda`` is imported
inside functions only."""

from __future__ import annotations

import functools
import operator
import threading
import types
from typing import Any

import numpy as np

from ferrodist.core import InvalidArgument
from ferrodist.core import cuda as core_cuda
from ferrodist.core.kernels import BAND, BOR, BXOR, MAX, MIN, PRODUCT, SUM

__all__ = [
    "DIVIDE",
    "MAX_ARRAYS_PER_LAUNCH",
    "MAX_BLOCKS",
    "THREADS_PER_BLOCK",
    "cuda_intrinsic",
    "half_functions",
    "halves",
    "jit_kernel",
    "launch",
    "launch_config",
    "op_function",
]

#: The opcode of scale's division (core's opcodes are the ReduceOp values).
DIVIDE = 100

#: Default threads per block of every launch.
THREADS_PER_BLOCK = 256
#: Default cap on blocks per launch: enough for one element (or one 16-byte vector) per
#: thread up to 2**28 of them at 256 threads, so a launch is as many full waves as the GPU
#: holds, never a wave and a sliver; past that the grid-stride loops take more turns.
#: Thread indices stay below 2**31 even at 1024 threads per block.
MAX_BLOCKS = 1 << 20
#: Arrays one pack/unpack launch moves: 64 one-dimensional array arguments and the offsets
#: table fit in the 4 KiB of kernel parameters that every CUDA version and GPU accepts.
MAX_ARRAYS_PER_LAUNCH = 64

# ---------------------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------------------


def launch_config(n: int, *, threads: int = THREADS_PER_BLOCK, max_blocks: int = MAX_BLOCKS) -> tuple[int, int]:
    """The grid ``(blocks, threads_per_block)`` for a grid-stride loop over ``n`` work items
    (elements, or 16-byte vectors for the wide kernels).

    A block has ``threads`` threads, or fewer for a small ``n`` (rounded up to a whole
    32-thread warp); there are ``ceil(n / threads_per_block)`` blocks, one item per
    thread, at most ``max_blocks`` (the loop then strides). No block is idle. ``n == 0``
    gives ``(0, 0)``: launch nothing.

    Example:
        >>> launch_config(10), launch_config(1000), launch_config(1 << 24), launch_config(10**9)
        ((1, 32), (4, 256), (65536, 256), (1048576, 256))
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


#: Launches under the simulator, one at a time: its kernel state is process-global, so
#: threads (ranks of ``run_world``, async work) must not run kernels concurrently there.
_SIMULATED_LAUNCHES = threading.Lock()


def launch(kernel: Any, n: int, stream: Any, threads: int, max_blocks: int, *args: Any) -> None:
    """Launch ``kernel`` over ``n`` items from any thread: Numba ready, and in a thread
    without a current context, the context of the device ``args[0]`` is on made current."""
    blocks, per_block = launch_config(n, threads=threads, max_blocks=max_blocks)
    if not blocks:
        return
    core_cuda.numba_cuda("a ferrodist.gpu kernel")
    with core_cuda.on_device_of(args[0]):
        configured = kernel[blocks, per_block, 0 if stream is None else stream]
        if core_cuda.simulated():
            with _SIMULATED_LAUNCHES:
                configured(*args)
        else:
            configured(*args)


def jit_kernel(fn: Any) -> Any:
    """``cuda.jit(fn)`` for a kernel that names ``cuda`` as a global.

    The simulator runs a kernel by swapping the fake ``cuda`` module into the kernel's
    globals, so ``cuda`` must be a global there, not a closure variable: the function is
    rebuilt over a private copy of its module's globals with ``numba.cuda`` added (its
    device functions stay closure variables, which Numba compiles as constants).
    """
    from numba import cuda

    scope = dict(fn.__globals__, cuda=cuda)
    return cuda.jit(types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__))


def cuda_intrinsic() -> Any:
    """numba-cuda's ``@intrinsic`` decorator (for code generated as LLVM IR on the GPU)."""
    try:
        from numba.cuda.extending import intrinsic
    except ImportError:  # pragma: no cover - numba-cuda releases before numba.cuda.extending
        from numba.extending import intrinsic  # type: ignore[assignment]
    return intrinsic


# ---------------------------------------------------------------------------------------
# Device functions (built on first use)
# ---------------------------------------------------------------------------------------


@functools.cache
def _hardware_half() -> tuple[Any, Any]:
    """float16 bits (the low 16 bits of an integer) to float32, and float32 to float16 bits
    rounded to nearest-even (a uint32): one ``cvt.f32.f16`` / ``cvt.rn.f16.f32`` each on a
    GPU, numpy's IEEE conversions under the simulator. NaN is the caller's to fix: the
    hardware's NaN bits are not the CPU kernels'."""
    if core_cuda.simulated():

        def f32_from_f16(bits):  # type: ignore[no-untyped-def]
            return np.float32(np.uint16(bits & 0xFFFF).view(np.float16))

        def f16_from_f32(x):  # type: ignore[no-untyped-def]
            with np.errstate(over="ignore"):
                return np.uint32(np.float16(x).view(np.uint16))

        return f32_from_f16, f16_from_f32

    from llvmlite import ir
    from numba import types as nb

    intrinsic = cuda_intrinsic()

    @intrinsic
    def f32_from_f16_bits(typingctx, bits):  # type: ignore[no-untyped-def]
        if not isinstance(bits, nb.Integer):
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            low = builder.trunc(args[0], ir.IntType(16)) if bits.bitwidth > 16 else args[0]
            if bits.bitwidth < 16:
                low = builder.zext(low, ir.IntType(16))
            return builder.fpext(builder.bitcast(low, ir.HalfType()), ir.FloatType())

        return nb.float32(bits), codegen

    @intrinsic
    def f16_bits_from_f32(typingctx, value):  # type: ignore[no-untyped-def]
        if value != nb.float32:
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            half = builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
            return builder.zext(half, ir.IntType(32))

        return nb.uint32(value), codegen

    return f32_from_f16_bits, f16_bits_from_f32


@functools.cache
def halves() -> dict[str, Any]:
    """Device functions: float16/bfloat16 bit patterns to float32 and back (nearest-even).

    ``*_load(h)`` widens the half in the low 16 bits of ``h`` (an unsigned integer: an
    element, or a 32-bit word of two), ``*_load_high(w)`` the one in the high 16 bits of a
    32-bit word; ``*_store(x)`` rounds a float32 to a half's bits, as a uint32 below 2**16.
    ``*_widen`` / ``*_widen_high`` are the loads that casts use (see below).

    All integer arithmetic is 32-bit: Numba types uint32 operations as uint64, so each
    result is cut back to uint32 (``np.uint32(...)``) and NVVM narrows the operations again
    (a 64-bit integer operation costs a GPU two or more 32-bit ones). Bit casts use scalar
    ``.view``: a register move on the GPU, numpy under the simulator. A NaN is fixed with a
    select, never a branch.

    bfloat16 is shifts and an integer rounding, as in ``ferrodist.core``. float16 uses the
    hardware conversions (IEEE, nearest-even, subnormals kept) with NaN set to the CPU
    kernels' bits where they are defined: rounded, any NaN becomes ``0x7E00`` with its
    sign; a cast widens a NaN with its sign and payload (``f16_widen``, as ``f16_to_f32``);
    MIN and MAX, which pass a NaN operand through to the rounding, widen it to the quiet
    NaN of its sign (``f16_load_signed``: all the rounding keeps). Arithmetic (SUM,
    PRODUCT, scaling) widens with the bare conversion (``f16_load``): which NaN an
    arithmetic instruction returns for a NaN operand is the hardware's choice anyway (its
    sign and payload are not part of the result's contract, on the CPU either), so fixing
    the operands would only cost integer instructions in every element.
    """
    from numba import cuda

    u32 = np.uint32
    f32_from_f16, f16_from_f32 = _hardware_half()

    @cuda.jit(device=True)
    def bits_of(x):  # type: ignore[no-untyped-def]
        return np.float32(x).view(np.uint32)

    @cuda.jit(device=True)
    def float_of(bits):  # type: ignore[no-untyped-def]
        return np.uint32(bits).view(np.float32)

    @cuda.jit(device=True)
    def bf16_load(h):  # type: ignore[no-untyped-def]
        return float_of(u32(h) << u32(16))

    @cuda.jit(device=True)
    def bf16_load_high(w):  # type: ignore[no-untyped-def]
        return float_of(u32(w) & u32(0xFFFF0000))

    @cuda.jit(device=True)
    def bf16_store(x):  # type: ignore[no-untyped-def]
        value = np.float32(x)
        bits = bits_of(value)
        quiet = u32((bits >> u32(16)) | u32(0x40))  # NaN: truncate, and keep it a quiet NaN
        rounded = u32(u32(bits + u32(0x7FFF) + ((bits >> u32(16)) & u32(1))) >> u32(16))
        return quiet if value != value else rounded  # a float compare: no integer instruction

    @cuda.jit(device=True)
    def f16_load(h):  # type: ignore[no-untyped-def]
        return f32_from_f16(h)

    @cuda.jit(device=True)
    def f16_load_high(w):  # type: ignore[no-untyped-def]
        return f32_from_f16(u32(w) >> u32(16))

    @cuda.jit(device=True)
    def f16_load_signed(h):  # type: ignore[no-untyped-def]
        value = f32_from_f16(h)
        quiet = float_of(u32(u32(u32(h) << u32(16)) & u32(0x80000000)) | u32(0x7FC00000))
        return quiet if value != value else value

    @cuda.jit(device=True)
    def f16_load_signed_high(w):  # type: ignore[no-untyped-def]
        value = f32_from_f16(u32(w) >> u32(16))
        quiet = float_of(u32(u32(w) & u32(0x80000000)) | u32(0x7FC00000))
        return quiet if value != value else value

    @cuda.jit(device=True)
    def f16_widen(h):  # type: ignore[no-untyped-def]
        value = f32_from_f16(h)
        sign, payload = u32(u32(u32(h) & u32(0x8000)) << u32(16)), u32(u32(u32(h) & u32(0x3FF)) << u32(13))
        nan = float_of(u32(sign | u32(0x7F800000)) | payload)
        return nan if value != value else value

    @cuda.jit(device=True)
    def f16_widen_high(w):  # type: ignore[no-untyped-def]
        return f16_widen(u32(w) >> u32(16))

    @cuda.jit(device=True)
    def f16_store(x):  # type: ignore[no-untyped-def]
        value = np.float32(x)
        rounded = f16_from_f32(value)
        quiet = u32(u32(u32(bits_of(value) >> u32(16)) & u32(0x8000)) | u32(0x7E00))
        return quiet if value != value else rounded

    return {
        "bits_of": bits_of,
        "float_of": float_of,
        "bf16_load": bf16_load,
        "bf16_load_high": bf16_load_high,
        "bf16_widen": bf16_load,
        "bf16_widen_high": bf16_load_high,
        "bf16_store": bf16_store,
        "f16_load": f16_load,
        "f16_load_high": f16_load_high,
        "f16_load_signed": f16_load_signed,
        "f16_load_signed_high": f16_load_signed_high,
        "f16_widen": f16_widen,
        "f16_widen_high": f16_widen_high,
        "f16_store": f16_store,
    }


def half_functions(kind: str, opcode: int) -> tuple[Any, Any, Any]:
    """``(load, load_high, store)`` of :func:`halves` for reducing or scaling ``kind``
    (``"float16"``/``"bfloat16"``) with ``opcode``: MIN and MAX widen a float16 NaN with
    its sign, arithmetic with the bare conversion."""
    functions = halves()
    if kind == "bfloat16":
        return functions["bf16_load"], functions["bf16_load_high"], functions["bf16_store"]
    signed = "_signed" if opcode in (MIN, MAX) else ""
    return functions[f"f16_load{signed}"], functions[f"f16_load{signed}_high"], functions["f16_store"]


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
