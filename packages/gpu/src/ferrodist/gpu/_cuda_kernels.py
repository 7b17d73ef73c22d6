"""CUDA kernels for host-staged GPU collectives (private): reduce, cast, scale (pack and
unpack are in ``_cuda_buckets``).

Each public function validates its arguments, picks a kernel, computes the grid with
:func:`launch_config` and launches once (``pack``/``unpack``: once per
:data:`MAX_ARRAYS_PER_LAUNCH` arrays, see ``_cuda_buckets``). Every kernel is a grid-stride loop, so any grid
covers any size. Arguments are Numba device arrays (``DeviceNDArray``, or the simulator's
``FakeCUDAArray``) that are C-contiguous; they are read as flat element sequences.

float16 and bfloat16 travel as their uint16 bit patterns (Numba has no bfloat16): a
reduction widens both operands to float32, combines them there and rounds once to
nearest-even, with the same bit manipulation as the CPU kernels in
``ferrodist.core._kernels``, so a GPU and a CPU rank agree bit for bit. bool is reduced as
its 0/1 bytes with the bitwise op core uses (SUM and MAX are OR, PRODUCT and MIN are AND).

Kernels are built on first use (``numba.cuda`` is imported inside functions only) and
cached per (op, dtype kind); Numba compiles one specialisation per argument type.
They run unchanged on a GPU and under ``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrodist.core import DType, InvalidArgument, ReduceOp, check_op, device_pointer, dtype
from ferrodist.core.kernels import BF16, F16, PRODUCT, plan

from ._cuda_device import (
    DIVIDE,
    MAX_ARRAYS_PER_LAUNCH,
    MAX_BLOCKS,
    THREADS_PER_BLOCK,
    halves,
    launch_config,
    op_function,
)
from ._cuda_device import launch as _launch

if TYPE_CHECKING:
    from numba import cuda  # at run time kernels get it through _kernel, never at import

__all__ = [
    "MAX_ARRAYS_PER_LAUNCH",
    "MAX_BLOCKS",
    "THREADS_PER_BLOCK",
    "cast",
    "launch_config",
    "reduce_into",
    "scale",
]


_HALVES = ("float16", "bfloat16")
_CASTS = (("float32", "bfloat16"), ("bfloat16", "float32"), ("float32", "float16"), ("float16", "float32"))


# ---------------------------------------------------------------------------------------
# Kernels (built on first use, one per op and dtype kind)
# ---------------------------------------------------------------------------------------


def _kernel(fn: Any) -> Any:
    """``cuda.jit(fn)`` for a kernel that names ``cuda`` as a global.

    The simulator runs a kernel by swapping the fake ``cuda`` module into the kernel's
    globals, so ``cuda`` must be a global there, not a closure variable: the function is
    rebuilt over a private copy of this module's globals with ``numba.cuda`` added (its
    device functions stay closure variables, which Numba compiles as constants).
    """
    from numba import cuda as numba_cuda

    scope = dict(globals(), cuda=numba_cuda)
    return numba_cuda.jit(types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__))


@functools.cache
def _reduce_kernel(kind: str, opcode: int) -> Any:
    """``dst[i] = op(dst[i], src[i])``; kind is ``"plain"`` (native arithmetic) or a half type."""
    combine = op_function(opcode)
    if kind == "plain":

        def reduce_plain(dst, src):  # type: ignore[no-untyped-def]
            for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
                dst[i] = combine(dst[i], src[i])

        return _kernel(reduce_plain)

    prefix = "f16" if kind == "float16" else "bf16"
    load, store = halves()[f"{prefix}_load"], halves()[f"{prefix}_store"]

    def reduce_half(dst, src):  # type: ignore[no-untyped-def]
        for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
            dst[i] = store(combine(load(dst[i]), load(src[i])))

    return _kernel(reduce_half)


@functools.cache
def _wide_reduce_kernel(kind: str, opcode: int) -> Any:
    """:func:`_reduce_kernel` reading and writing 8 bytes at a time: four float16/bfloat16
    or two float32 per load (``dst64``/``src64``: the same memory as uint64). The elements
    past the last whole word (fewer than a word's worth) are done by the first threads
    through ``dst``/``src``. Each element is combined exactly as the narrow kernel does."""
    from numba import uint64

    combine = op_function(opcode)
    bits_of, float_of = halves()["bits_of"], halves()["float_of"]
    if kind == "float32":

        def reduce_f32x2(dst64, src64, dst, src):  # type: ignore[no-untyped-def]
            start = cuda.grid(1)
            for i in range(start, dst64.shape[0], cuda.gridsize(1)):
                a, b = dst64[i], src64[i]
                low = combine(float_of(a & uint64(0xFFFFFFFF)), float_of(b & uint64(0xFFFFFFFF)))
                high = combine(float_of(a >> uint64(32)), float_of(b >> uint64(32)))
                dst64[i] = uint64(bits_of(low)) | (uint64(bits_of(high)) << uint64(32))
            tail = dst64.shape[0] * 2 + start
            if tail < dst.shape[0]:
                dst[tail] = combine(dst[tail], src[tail])

        return _kernel(reduce_f32x2)

    prefix = "f16" if kind == "float16" else "bf16"
    load, store = halves()[f"{prefix}_load"], halves()[f"{prefix}_store"]

    def reduce_half_x4(dst64, src64, dst, src):  # type: ignore[no-untyped-def]
        start = cuda.grid(1)
        for i in range(start, dst64.shape[0], cuda.gridsize(1)):
            a, b = dst64[i], src64[i]
            out = uint64(0)
            for k in range(4):
                shift = uint64(16 * k)
                low_a, low_b = (a >> shift) & uint64(0xFFFF), (b >> shift) & uint64(0xFFFF)
                out |= uint64(store(combine(load(low_a), load(low_b)))) << shift
            dst64[i] = out
        tail = dst64.shape[0] * 4 + start
        if tail < dst.shape[0]:
            dst[tail] = store(combine(load(dst[tail]), load(src[tail])))

    return _kernel(reduce_half_x4)


@functools.cache
def _scale_kernel(kind: str, opcode: int) -> Any:
    """``dst[i] = dst[i] * factor`` (or ``/``), in float64 for float64 and float32 otherwise."""
    combine = op_function(opcode)
    if kind == "float64":

        def scale_f64(dst, factor):  # type: ignore[no-untyped-def]
            f = np.float64(factor)
            for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
                dst[i] = combine(dst[i], f)

        return _kernel(scale_f64)
    if kind == "float32":

        def scale_f32(dst, factor):  # type: ignore[no-untyped-def]
            f = np.float32(factor)
            for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
                dst[i] = combine(dst[i], f)

        return _kernel(scale_f32)

    prefix = "f16" if kind == "float16" else "bf16"
    load, store = halves()[f"{prefix}_load"], halves()[f"{prefix}_store"]

    def scale_half(dst, factor):  # type: ignore[no-untyped-def]
        f = np.float32(factor)
        for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
            dst[i] = store(combine(load(dst[i]), f))

    return _kernel(scale_half)


@functools.cache
def _cast_kernel(src_name: str, dst_name: str) -> Any:
    """``dst[i] = convert(src[i])`` for one of the float32 <-> float16/bfloat16 pairs."""
    half = src_name if src_name in _HALVES else dst_name
    prefix = "f16" if half == "float16" else "bf16"
    convert = halves()[f"{prefix}_load" if src_name == half else f"{prefix}_store"]

    def cast_kernel(dst, src):  # type: ignore[no-untyped-def]
        for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
            dst[i] = convert(src[i])

    return _kernel(cast_kernel)


@functools.cache
def _wide_cast_kernel(src_name: str, dst_name: str) -> Any:
    """:func:`_cast_kernel` two elements at a time: two float32 as one uint64 and two
    halves as one uint32 (``dst2``/``src2``); the last odd element through ``dst``/``src``."""
    from numba import uint32, uint64

    half = src_name if src_name in _HALVES else dst_name
    prefix = "f16" if half == "float16" else "bf16"
    functions = halves()
    load, store = functions[f"{prefix}_load"], functions[f"{prefix}_store"]
    bits_of, float_of = functions["bits_of"], functions["float_of"]
    if src_name == half:

        def widen_x2(dst2, src2, dst, src):  # type: ignore[no-untyped-def]
            start = cuda.grid(1)
            for i in range(start, dst2.shape[0], cuda.gridsize(1)):
                pair = src2[i]
                low = uint64(bits_of(load(pair & uint32(0xFFFF))))
                high = uint64(bits_of(load(pair >> uint32(16))))
                dst2[i] = low | (high << uint64(32))
            tail = dst2.shape[0] * 2 + start
            if tail < dst.shape[0]:
                dst[tail] = load(src[tail])

        return _kernel(widen_x2)

    def narrow_x2(dst2, src2, dst, src):  # type: ignore[no-untyped-def]
        start = cuda.grid(1)
        for i in range(start, dst2.shape[0], cuda.gridsize(1)):
            pair = src2[i]
            low = uint32(store(float_of(pair & uint64(0xFFFFFFFF))))
            high = uint32(store(float_of(pair >> uint64(32))))
            dst2[i] = low | (high << uint32(16))
        tail = dst2.shape[0] * 2 + start
        if tail < dst.shape[0]:
            dst[tail] = store(src[tail])

    return _kernel(narrow_x2)


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def _flat(array: Any, what: str, operation: str) -> Any:
    """``array`` as a one-dimensional view, after checking that it is a contiguous device array."""
    if not getattr(array, "__cuda_ndarray__", False):
        raise InvalidArgument(
            f"{operation}: {what} is a {type(array).__name__}, not a Numba device array; pass "
            "numba.cuda.to_device(x), or ferrodist.core.as_tensor(x).device_array() for a torch/CuPy array"
        )
    if not array.is_c_contiguous():
        raise InvalidArgument(
            f"{operation}: {what} (shape {tuple(array.shape)}, strides {tuple(array.strides)}) is not "
            "C-contiguous; the kernels read flat memory: pass a contiguous copy"
        )
    return array.reshape(array.size)


def _storage(array: Any, dt: DType, what: str, operation: str) -> Any:
    """The flat array the kernels see for ``dt``: halves as uint16 bits, bool as uint8 bytes."""
    flat = _flat(array, what, operation)
    allowed = {dt.numpy, np.dtype(np.uint16)} if dt.name in _HALVES else {dt.numpy}
    if flat.dtype not in allowed:
        names = " or ".join(sorted(str(a) for a in allowed))
        raise InvalidArgument(
            f"{operation}: {what} has dtype {flat.dtype} but {dt.name} data must be stored as {names}; "
            "convert it first (the kernels never mix dtypes)"
        )
    if dt.name in _HALVES:
        return flat.view(np.uint16)
    if dt.name == "bool":
        return flat.view(np.uint8)
    return flat


def _words(flat: Any, per: int, word: type) -> Any:
    """The leading whole words of ``flat`` (``per`` elements each) as a ``word`` array over
    the same memory, or None when there is no whole word or the memory is not aligned to
    one (a view at an odd offset): the wide kernels then are not used."""
    count = flat.shape[0] // per
    size = np.dtype(word).itemsize
    if count == 0 or device_pointer(flat) % size:
        return None
    return flat[: count * per].view(word)


def _launch_wide(
    kernel: Any, n: int, words: int, per: int, stream: Any, threads: int, max_blocks: int, *args: Any
) -> None:
    """Launch a wide kernel over ``words`` words, with at least as many threads as the
    elements past the last word (the first threads do those)."""
    _launch(kernel, max(words, n - words * per), stream, threads, max_blocks, *args)


def _same_size(dst: Any, src: Any, operation: str) -> None:
    if dst.size != src.size:
        raise InvalidArgument(
            f"{operation}: the source has {src.size} elements (shape {tuple(src.shape)}) but the destination "
            f"has {dst.size} (shape {tuple(dst.shape)}); pass arrays of the same size"
        )


# ---------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------


def reduce_into(
    dst: Any,
    src: Any,
    dt: DType | str,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    stream: Any = None,
    threads: int = THREADS_PER_BLOCK,
    max_blocks: int = MAX_BLOCKS,
) -> None:
    """``dst[i] = op(dst[i], src[i])`` on the device, in one launch (a received chunk folded in).

    ``AVG`` adds, like ``SUM``: the caller divides once at the end with
    ``scale(dst, dt, world_size, divide=True)``. float16 and bfloat16 (uint16 bit patterns)
    are combined in float32 and rounded once to nearest-even; integers wrap around like
    numpy; bool SUM/MAX are OR and PRODUCT/MIN are AND.

    Args:
        dst: device array of ``dt``, updated in place.
        src: device array of ``dt`` with as many elements as ``dst``.
        dt: the ferrodist dtype of both (needed because bfloat16 is stored as uint16).
        op: the reduce op; must be in ``dt.ops``.
        stream: the CUDA stream to launch on (default: the default stream).
        threads: threads per block (see :func:`launch_config`).
        max_blocks: most blocks per launch.

    Raises:
        InvalidArgument: not device arrays, wrong dtype, different sizes, or an op the dtype lacks.

    Example:
        >>> d = cuda.to_device(np.array([1, 5], np.int32))
        >>> reduce_into(d, cuda.to_device(np.array([4, 2], np.int32)), "int32", "min")
        >>> d.copy_to_host()
        array([1, 2], dtype=int32)
    """
    operation = "gpu reduce_into"
    dt, op = dtype(dt), ReduceOp.coerce(op)
    check_op(op, dt, operation=operation)
    out = _storage(dst, dt, "the destination", operation)
    inp = _storage(src, dt, "the source", operation)
    _same_size(out, inp, operation)
    kind, _, opcode = plan(dt, op)  # core's one table: AVG folds as SUM, bool's ops as OR/AND
    name = {BF16: "bfloat16", F16: "float16"}.get(kind, "plain")
    wide = name if name != "plain" else "float32" if dt.name == "float32" else None
    if wide is not None:  # 8-byte loads: four halves or two float32 per load
        per = 4 if wide != "float32" else 2
        words_out, words_in = _words(out, per, np.uint64), _words(inp, per, np.uint64)
        if words_out is not None and words_in is not None:
            kernel = _wide_reduce_kernel(wide, opcode)
            _launch_wide(
                kernel, out.size, words_out.size, per, stream, threads, max_blocks, words_out, words_in, out, inp
            )
            return
    _launch(_reduce_kernel(name, opcode), out.size, stream, threads, max_blocks, out, inp)


def scale(
    dst: Any,
    dt: DType | str,
    factor: float,
    *,
    divide: bool = False,
    stream: Any = None,
    threads: int = THREADS_PER_BLOCK,
    max_blocks: int = MAX_BLOCKS,
) -> None:
    """``dst[i] *= factor`` (or ``/= factor`` with ``divide=True``) for floating dtypes.

    float64 computes in float64; float32, float16 and bfloat16 in float32 with ``factor``
    rounded to float32, each element rounded once to its own type (nearest-even). AVG's
    final step is ``scale(dst, dt, world_size, divide=True)``.

    Args:
        dst: device array of ``dt`` (float16/bfloat16 as uint16 bits), updated in place.
        dt: a floating ferrodist dtype.
        factor: the multiplier, or the divisor with ``divide=True`` (then non-zero).
        divide: divide by ``factor`` instead of multiplying.
        stream: the CUDA stream to launch on (default: the default stream).
        threads: threads per block (see :func:`launch_config`).
        max_blocks: most blocks per launch.

    Raises:
        InvalidArgument: a non-floating dtype, a wrong array, or a division by zero.

    Example:
        >>> d = cuda.to_device(np.array([3.0, 5.0], np.float32))
        >>> scale(d, "float32", 2, divide=True)  # AVG over 2 ranks: each rank sees [1.5, 2.5]
        >>> d.copy_to_host()
        array([1.5, 2.5], dtype=float32)
    """
    operation = "gpu scale"
    dt = dtype(dt)
    if not dt.is_floating:
        raise InvalidArgument(f"{operation}: {dt.name} is not a floating dtype; scale float16/bfloat16/float32/float64")
    try:
        factor = float(factor)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{operation}: factor {factor!r} is not a number") from None
    if divide and factor == 0.0:
        raise InvalidArgument(f"{operation}: dividing by zero; pass the number of ranks (>= 1) for AVG")
    out = _storage(dst, dt, "the destination", operation)
    kernel = _scale_kernel(dt.name, DIVIDE if divide else PRODUCT)
    _launch(kernel, out.size, stream, threads, max_blocks, out, factor)


def cast(
    dst: Any,
    dst_dtype: DType | str,
    src: Any,
    src_dtype: DType | str,
    *,
    stream: Any = None,
    threads: int = THREADS_PER_BLOCK,
    max_blocks: int = MAX_BLOCKS,
) -> None:
    """Convert ``src`` into ``dst`` between float32 and float16 or bfloat16.

    Widening is exact; narrowing rounds to nearest-even, overflows to infinity and keeps
    NaN a NaN (bfloat16 keeps the sign and top payload bits, float16 gives a quiet NaN of
    the same sign), bit for bit as ``ferrodist.core`` does on the CPU.

    Args:
        dst: device array of ``dst_dtype`` (a half type as uint16 bits, or float32).
        dst_dtype: the destination's ferrodist dtype.
        src: device array of ``src_dtype`` with as many elements as ``dst``.
        src_dtype: the source's ferrodist dtype.
        stream: the CUDA stream to launch on (default: the default stream).
        threads: threads per block (see :func:`launch_config`).
        max_blocks: most blocks per launch.

    Raises:
        InvalidArgument: an unsupported pair of dtypes, wrong arrays or different sizes.

    Example:
        >>> src = cuda.to_device(np.array([1.0, 1.00390625], np.float32))
        >>> dst = cuda.device_array(2, np.uint16)
        >>> cast(dst, "bfloat16", src, "float32")  # 1 + 2**-8 is a tie: rounds to even 1.0
        >>> dst.copy_to_host()
        array([16256, 16256], dtype=uint16)
    """
    operation = "gpu cast"
    to, frm = dtype(dst_dtype), dtype(src_dtype)
    if (frm.name, to.name) not in _CASTS:
        pairs = ", ".join(f"{a} -> {b}" for a, b in _CASTS)
        raise InvalidArgument(f"{operation}: cannot convert {frm.name} to {to.name}; supported: {pairs}")
    out = _storage(dst, to, "the destination", operation)
    inp = _storage(src, frm, "the source", operation)
    _same_size(out, inp, operation)
    out_word, in_word = (np.uint32, np.uint64) if frm.name == "float32" else (np.uint64, np.uint32)
    pairs_out, pairs_in = _words(out, 2, out_word), _words(inp, 2, in_word)
    if pairs_out is not None and pairs_in is not None:  # two elements per load and per store
        kernel = _wide_cast_kernel(frm.name, to.name)
        _launch_wide(kernel, out.size, pairs_out.size, 2, stream, threads, max_blocks, pairs_out, pairs_in, out, inp)
        return
    _launch(_cast_kernel(frm.name, to.name), out.size, stream, threads, max_blocks, out, inp)
