"""CUDA kernels for host-staged GPU collectives (private): reduce, cast, scale (pack and
unpack are in ``_cuda_buckets``).

Each public function validates its arguments, picks a kernel, computes the grid with
:func:`launch_config` and launches once (``pack``/``unpack``: once per
:data:`MAX_ARRAYS_PER_LAUNCH` arrays, see ``_cuda_buckets``). Every kernel is a grid-stride
loop, so any grid covers any size. Arguments are anything ``ferrodist.core.as_tensor``
views on a CUDA device without a copy (a Numba device array, a ferrodist CUDA ``Tensor``,
a torch or CuPy CUDA tensor), C-contiguous; they are read as flat element sequences.

float16 and bfloat16 travel as their 16-bit patterns (Numba has no bfloat16; torch hands
bfloat16 over as int16): a reduction widens both operands to float32, combines them there
and rounds once to nearest-even, with the same results as the CPU kernels in
``ferrodist.core._kernels``, so a GPU and a CPU rank agree bit for bit. bool is reduced as
its 0/1 bytes with the bitwise op core uses (SUM and MAX are OR, PRODUCT and MIN are AND).

float32, float16 and bfloat16 arrays whose first elements are 16-byte aligned (as every
allocation is) go through the wide kernels of ``_cuda_vector`` (16-byte loads and stores,
one vector per thread); other views and the other dtypes go element by element.

Kernels are built on first use (``numba.cuda`` is imported inside functions only) and
cached per (op, dtype kind); Numba compiles one specialisation per argument type.
They run unchanged on a GPU and under ``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrodist.core import DType, InvalidArgument, ReduceOp, as_tensor, check_op, device_pointer, dtype
from ferrodist.core.kernels import BF16, F16, PRODUCT, plan

from ._cuda_device import (
    DIVIDE,
    MAX_ARRAYS_PER_LAUNCH,
    MAX_BLOCKS,
    THREADS_PER_BLOCK,
    half_functions,
    halves,
    jit_kernel,
    launch_config,
    op_function,
)
from ._cuda_device import launch as _launch
from ._cuda_vector import ELEMENTS_PER_VECTOR, VECTOR_BYTES
from ._cuda_vector import cast_kernel as _wide_cast_kernel
from ._cuda_vector import reduce_kernel as _wide_reduce_kernel
from ._cuda_vector import scale_kernel as _wide_scale_kernel

if TYPE_CHECKING:
    from numba import cuda  # at run time kernels get it through jit_kernel, never at import

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
_WIDE = ("float32", *_HALVES)
_CASTS = (("float32", "bfloat16"), ("bfloat16", "float32"), ("float32", "float16"), ("float16", "float32"))


# ---------------------------------------------------------------------------------------
# Element-wise kernels (built on first use, one per op and dtype kind): every dtype, and
# the float types' views that are not 16-byte aligned
# ---------------------------------------------------------------------------------------


@functools.cache
def _reduce_kernel(kind: str, opcode: int) -> Any:
    """``dst[i] = op(dst[i], src[i])``; kind is ``"plain"`` (native arithmetic) or a half type."""
    combine = op_function(opcode)
    if kind == "plain":

        def reduce_plain(dst, src):  # type: ignore[no-untyped-def]
            for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
                dst[i] = combine(dst[i], src[i])

        return jit_kernel(reduce_plain)

    load, _, store = half_functions(kind, opcode)

    def reduce_half(dst, src):  # type: ignore[no-untyped-def]
        for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
            dst[i] = store(combine(load(dst[i]), load(src[i])))

    return jit_kernel(reduce_half)


@functools.cache
def _scale_kernel(kind: str, opcode: int) -> Any:
    """``dst[i] = dst[i] * factor`` (or ``/``), in float64 for float64 and float32 otherwise."""
    combine = op_function(opcode)
    if kind == "float64":

        def scale_f64(dst, factor):  # type: ignore[no-untyped-def]
            f = np.float64(factor)
            for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
                dst[i] = combine(dst[i], f)

        return jit_kernel(scale_f64)
    if kind == "float32":

        def scale_f32(dst, factor):  # type: ignore[no-untyped-def]
            f = np.float32(factor)
            for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
                dst[i] = combine(dst[i], f)

        return jit_kernel(scale_f32)

    load, _, store = half_functions(kind, opcode)

    def scale_half(dst, factor):  # type: ignore[no-untyped-def]
        f = np.float32(factor)
        for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
            dst[i] = store(combine(load(dst[i]), f))

    return jit_kernel(scale_half)


@functools.cache
def _cast_kernel(src_name: str, dst_name: str) -> Any:
    """``dst[i] = convert(src[i])`` for one of the float32 <-> float16/bfloat16 pairs."""
    half = src_name if src_name in _HALVES else dst_name
    prefix = "f16" if half == "float16" else "bf16"
    convert = halves()[f"{prefix}_widen" if src_name == half else f"{prefix}_store"]

    def cast_kernel(dst, src):  # type: ignore[no-untyped-def]
        for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
            dst[i] = convert(src[i])

    return jit_kernel(cast_kernel)


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def _device_array(obj: Any, what: str, operation: str) -> tuple[Any, DType | None]:
    """The Numba device array under ``obj`` (no copy), and the dtype ``obj`` says it holds:
    None for a Numba device array (its own dtype tells); anything else goes through
    ``ferrodist.core.as_tensor`` (a ``Tensor``, a torch or CuPy CUDA tensor, any
    ``__cuda_array_interface__`` or CUDA DLPack object), which knows that a torch bfloat16
    tensor's int16 array holds bfloat16."""
    if getattr(obj, "__cuda_ndarray__", False):
        return obj, None
    try:
        tensor = as_tensor(obj)
    except InvalidArgument:
        tensor = None
    if tensor is None or not tensor.is_cuda:
        raise InvalidArgument(
            f"{operation}: {what} is a {type(obj).__name__}, not a Numba device array or a CUDA tensor; pass "
            "numba.cuda.to_device(x), a torch/CuPy CUDA tensor or a ferrodist CUDA Tensor"
        )
    return tensor.device_array(), tensor.dtype


def _flat(array: Any, what: str, operation: str) -> Any:
    """``array`` as a one-dimensional device array, after checking that it is a contiguous
    device array (or a CUDA tensor over one)."""
    found, _ = _device_array(array, what, operation)
    return _contiguous(found, what, operation)


def _contiguous(array: Any, what: str, operation: str) -> Any:
    if not array.is_c_contiguous():
        raise InvalidArgument(
            f"{operation}: {what} (shape {tuple(array.shape)}, strides {tuple(array.strides)}) is not "
            "C-contiguous; the kernels read flat memory: pass a contiguous copy"
        )
    return array.reshape(array.size)


def _operand(obj: Any, what: str, operation: str) -> tuple[Any, DType | None]:
    array, held = _device_array(obj, what, operation)
    return _contiguous(array, what, operation), held


def _dtype_of(dt: DType | str | None, operands: list[tuple[Any, DType | None]]) -> DType:
    """``dt``, or where it is None the dtype the first operand carries (a ``Tensor`` knows
    it holds bfloat16), or that operand's own element type."""
    if dt is not None:
        return dtype(dt)
    flat, held = operands[0]
    return held if held is not None else dtype(flat.dtype)


def _storage(operand: tuple[Any, DType | None], dt: DType, what: str, operation: str) -> Any:
    """The flat array the kernels see for ``dt``: halves as uint16 bits (stored as the half
    type, uint16 or int16), bool as uint8 bytes."""
    flat, held = operand
    name = held.name if held is not None else flat.dtype.name
    allowed = {dt.name, "uint16", "int16"} if dt.name in _HALVES else {dt.name}
    if name not in allowed:
        names = " or ".join(sorted(allowed))
        raise InvalidArgument(
            f"{operation}: {what} has dtype {name} but {dt.name} data must be stored as {names}; "
            "convert it first (the kernels never mix dtypes)"
        )
    if dt.name in _HALVES:
        return flat.view(np.uint16)
    if dt.name == "bool":
        return flat.view(np.uint8)
    return flat


def _aligned(*arrays: Any) -> bool:
    """True when every array's first element sits on a 16-byte boundary (the wide kernels' vectors)."""
    return all(device_pointer(a) % VECTOR_BYTES == 0 for a in arrays)


def _launch_wide(kernel: Any, n: int, per: int, stream: Any, threads: int, max_blocks: int, *args: Any) -> None:
    """Launch a wide kernel: one thread per vector of ``per`` elements, and at least as many
    threads as the elements past the last whole vector (the first threads do those)."""
    _launch(kernel, max(n // per, n % per), stream, threads, max_blocks, *args)


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
    dt: DType | str | None = None,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    stream: Any = None,
    threads: int = THREADS_PER_BLOCK,
    max_blocks: int = MAX_BLOCKS,
) -> None:
    """``dst[i] = op(dst[i], src[i])`` on the device, in one launch (a received chunk folded in).

    ``AVG`` adds, like ``SUM``: the caller divides once at the end with
    ``scale(dst, dt, world_size, divide=True)``. float16 and bfloat16 are combined in
    float32 and rounded once to nearest-even; integers wrap around like numpy; bool SUM/MAX
    are OR and PRODUCT/MIN are AND. float32, float16 and bfloat16 arrays that start on a
    16-byte boundary are read and written 16 bytes at a time.

    Args:
        dst: CUDA array of ``dt``, updated in place: a Numba device array, a ferrodist CUDA
            ``Tensor``, or a torch/CuPy CUDA tensor (no copy is made).
        src: CUDA array of ``dt`` with as many elements as ``dst``.
        dt: the ferrodist dtype of both; by default the one ``dst`` carries (a ``Tensor``
            or torch tensor knows it holds bfloat16; a Numba device array of uint16 bits
            does not: pass ``"bfloat16"`` or ``"float16"`` for those).
        op: the reduce op; must be in ``dt.ops``.
        stream: the CUDA stream to launch on (default: the default stream).
        threads: threads per block (see :func:`launch_config`).
        max_blocks: most blocks per launch.

    Raises:
        InvalidArgument: not CUDA arrays, wrong dtype, different sizes, or an op the dtype lacks.

    Example:
        >>> d = cuda.to_device(np.array([1, 5], np.int32))
        >>> reduce_into(d, cuda.to_device(np.array([4, 2], np.int32)), "int32", "min")
        >>> d.copy_to_host()
        array([1, 2], dtype=int32)
        >>> grads = torch.ones(4, dtype=torch.bfloat16, device="cuda")
        >>> reduce_into(grads, torch.full_like(grads, 2))  # bfloat16, from the tensor
        >>> grads
        tensor([3., 3., 3., 3.], device='cuda:0', dtype=torch.bfloat16)
    """
    operation = "gpu reduce_into"
    operands = [_operand(dst, "the destination", operation), _operand(src, "the source", operation)]
    dt, op = _dtype_of(dt, operands), ReduceOp.coerce(op)
    check_op(op, dt, operation=operation)
    out = _storage(operands[0], dt, "the destination", operation)
    inp = _storage(operands[1], dt, "the source", operation)
    _same_size(out, inp, operation)
    kind, _, opcode = plan(dt, op)  # core's one table: AVG folds as SUM, bool's ops as OR/AND
    if dt.name in _WIDE and _aligned(out, inp):
        kernel, per = _wide_reduce_kernel(dt.name, opcode), ELEMENTS_PER_VECTOR[out.dtype.itemsize]
        _launch_wide(kernel, out.size, per, stream, threads, max_blocks, out, inp)
        return
    name = {BF16: "bfloat16", F16: "float16"}.get(kind, "plain")
    _launch(_reduce_kernel(name, opcode), out.size, stream, threads, max_blocks, out, inp)


def scale(
    dst: Any,
    dt: DType | str | None = None,
    factor: float | None = None,
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
        dst: CUDA array of ``dt`` (see :func:`reduce_into`), updated in place.
        dt: a floating ferrodist dtype; by default the one ``dst`` carries.
        factor: the multiplier, or the divisor with ``divide=True`` (then non-zero).
        divide: divide by ``factor`` instead of multiplying.
        stream: the CUDA stream to launch on (default: the default stream).
        threads: threads per block (see :func:`launch_config`).
        max_blocks: most blocks per launch.

    Raises:
        InvalidArgument: a non-floating dtype, a wrong array, no factor or a division by zero.

    Example:
        >>> d = cuda.to_device(np.array([3.0, 5.0], np.float32))
        >>> scale(d, "float32", 2, divide=True)  # AVG over 2 ranks: each rank sees [1.5, 2.5]
        >>> d.copy_to_host()
        array([1.5, 2.5], dtype=float32)
    """
    operation = "gpu scale"
    operand = _operand(dst, "the destination", operation)
    dt = _dtype_of(dt, [operand])
    if not dt.is_floating:
        raise InvalidArgument(f"{operation}: {dt.name} is not a floating dtype; scale float16/bfloat16/float32/float64")
    if factor is None:
        raise InvalidArgument(f"{operation}: no factor; pass the multiplier (or the divisor with divide=True)")
    try:
        factor = float(factor)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{operation}: factor {factor!r} is not a number") from None
    if divide and factor == 0.0:
        raise InvalidArgument(f"{operation}: dividing by zero; pass the number of ranks (>= 1) for AVG")
    out = _storage(operand, dt, "the destination", operation)
    opcode = DIVIDE if divide else PRODUCT
    if dt.name in _WIDE and _aligned(out):
        kernel, per = _wide_scale_kernel(dt.name, opcode), ELEMENTS_PER_VECTOR[out.dtype.itemsize]
        _launch_wide(kernel, out.size, per, stream, threads, max_blocks, out, factor)
        return
    _launch(_scale_kernel(dt.name, opcode), out.size, stream, threads, max_blocks, out, factor)


def cast(
    dst: Any,
    dst_dtype: DType | str | None = None,
    src: Any = None,
    src_dtype: DType | str | None = None,
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
        dst: CUDA array of ``dst_dtype`` (see :func:`reduce_into`).
        dst_dtype: the destination's ferrodist dtype; by default the one ``dst`` carries.
        src: CUDA array of ``src_dtype`` with as many elements as ``dst`` (required).
        src_dtype: the source's ferrodist dtype; by default the one ``src`` carries.
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
    if src is None:
        raise InvalidArgument(f"{operation}: no source; pass src, the array to convert")
    out_operand, in_operand = _operand(dst, "the destination", operation), _operand(src, "the source", operation)
    to, frm = _dtype_of(dst_dtype, [out_operand]), _dtype_of(src_dtype, [in_operand])
    if (frm.name, to.name) not in _CASTS:
        pairs = ", ".join(f"{a} -> {b}" for a, b in _CASTS)
        raise InvalidArgument(f"{operation}: cannot convert {frm.name} to {to.name}; supported: {pairs}")
    out = _storage(out_operand, to, "the destination", operation)
    inp = _storage(in_operand, frm, "the source", operation)
    _same_size(out, inp, operation)
    if _aligned(out, inp):  # eight elements a turn: one vector of halves, two of float32
        kernel = _wide_cast_kernel(frm.name, to.name)
        _launch_wide(kernel, out.size, ELEMENTS_PER_VECTOR[2], stream, threads, max_blocks, out, inp)
        return
    _launch(_cast_kernel(frm.name, to.name), out.size, stream, threads, max_blocks, out, inp)
