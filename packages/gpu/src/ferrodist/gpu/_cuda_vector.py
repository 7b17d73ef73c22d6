"""The wide CUDA kernels (private): reduce, scale and cast 16 bytes at a time.

Each thread moves one 16-byte vector per turn of its grid-stride loop: four float32 or
eight float16/bfloat16 bit patterns, read with ``ld.global.v4`` and written with
``st.global.v4`` (as torch's elementwise kernels do; Numba has no vector dtypes, so
:func:`lanes` provides the two operations as intrinsics over an array's data pointer, with
no negative-index wraparound). The callers in ``_cuda_kernels`` use these kernels only when
every array's first element is 16-byte aligned; the elements past the last whole vector
(fewer than one vector's worth) are done by the first threads, one each, so a launch has
``max(vectors, leftover)`` work items. Each element is combined, scaled or converted exactly
as the element-wise kernels do it, with the device functions of ``_cuda_device``.

Under the simulator the intrinsics cannot run: plain Python stand-ins take their place
(and check the alignment that the hardware would fault on).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrodist.core import cuda as core_cuda

from ._cuda_device import cuda_intrinsic, half_functions, halves, jit_kernel, op_function

if TYPE_CHECKING:
    from numba import cuda  # at run time kernels get it through jit_kernel, never at import

__all__ = ["ELEMENTS_PER_VECTOR", "VECTOR_BYTES", "cast_kernel", "lanes", "reduce_kernel", "scale_kernel"]

#: Bytes one vector load or store moves.
VECTOR_BYTES = 16
#: Elements per vector of each storage width in bytes (float32: 4, the halves: 8).
ELEMENTS_PER_VECTOR = {4: 4, 2: 8}


@functools.cache
def lanes() -> tuple[Any, Any]:
    """``(load, store)``: ``load(array, i)`` reads the 16 bytes at element ``i`` of a
    one-dimensional C-contiguous float32 or 16-bit array as four 32-bit lanes (float32 for
    a float32 array, else uint32 holding two elements each, element ``i + 2k`` in the low
    half of lane ``k``); ``store(array, i, a, b, c, d)`` writes four lanes back. ``i`` must
    put the address on a 16-byte boundary (the caller checks the array's alignment and
    passes multiples of the lane count)."""
    if core_cuda.simulated():
        return _load_stand_in, _store_stand_in
    return _intrinsics()


def _aligned(array: Any, i: int) -> None:
    address = int(array._ary.ctypes.data) + int(i) * array.dtype.itemsize
    if address % VECTOR_BYTES:
        raise RuntimeError(f"a 16-byte vector access at address {address:#x} is misaligned (element {i})")


def _load_stand_in(array, i):  # type: ignore[no-untyped-def]
    _aligned(array, i)
    if array.dtype == np.float32:
        return array[i], array[i + 1], array[i + 2], array[i + 3]
    return tuple(np.uint32(array[i + 2 * k]) | (np.uint32(array[i + 2 * k + 1]) << np.uint32(16)) for k in range(4))


def _store_stand_in(array, i, a, b, c, d):  # type: ignore[no-untyped-def]
    _aligned(array, i)
    if array.dtype == np.float32:
        array[i], array[i + 1], array[i + 2], array[i + 3] = a, b, c, d
        return
    for k, word in enumerate((a, b, c, d)):
        array[i + 2 * k] = np.uint16(word & np.uint32(0xFFFF))
        array[i + 2 * k + 1] = np.uint16(word >> np.uint32(16))


def _intrinsics() -> tuple[Any, Any]:
    from llvmlite import ir
    from numba import types

    intrinsic = cuda_intrinsic()

    def lane_type(array: Any) -> Any:
        if not (isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C"):
            return None
        if array.dtype == types.float32:
            return types.float32
        if array.dtype in (types.uint16, types.int16):
            return types.uint32
        return None

    def vector_pointer(context: Any, builder: Any, signature: Any, args: Any, lane: Any) -> tuple[Any, Any]:
        array_type, index_type = signature.args[:2]
        data = context.make_array(array_type)(context, builder, args[0]).data
        index = context.cast(builder, args[1], index_type, types.intp)
        element = builder.gep(data, [index], inbounds=True)
        vector = ir.VectorType(context.get_value_type(lane), 4)
        return vector, builder.addrspacecast(builder.bitcast(element, vector.as_pointer()), vector.as_pointer(1))

    @intrinsic
    def load_lanes(typingctx, array, index):  # type: ignore[no-untyped-def]
        lane = lane_type(array)
        if lane is None or not isinstance(index, types.Integer):
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            _, pointer = vector_pointer(context, builder, signature, args, lane)
            value = builder.load(pointer, align=VECTOR_BYTES)
            items = [builder.extract_element(value, ir.Constant(ir.IntType(32), k)) for k in range(4)]
            return context.make_tuple(builder, signature.return_type, items)

        return types.UniTuple(lane, 4)(array, index), codegen

    @intrinsic
    def store_lanes(typingctx, array, index, a, b, c, d):  # type: ignore[no-untyped-def]
        lane = lane_type(array)
        values = (a, b, c, d)
        if lane is None or not isinstance(index, types.Integer):
            return None
        if lane == types.float32 and any(v != types.float32 for v in values):
            return None  # a float lane must already be float32: no second rounding here
        if lane == types.uint32 and not all(isinstance(v, types.Integer) for v in values):
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            vector, pointer = vector_pointer(context, builder, signature, args, lane)
            value = ir.Constant(vector, ir.Undefined)
            for k in range(4):
                item = context.cast(builder, args[2 + k], signature.args[2 + k], lane)
                value = builder.insert_element(value, item, ir.Constant(ir.IntType(32), k))
            builder.store(value, pointer, align=VECTOR_BYTES)
            return context.get_dummy_value()

        return types.void(array, index, a, b, c, d), codegen

    return load_lanes, store_lanes


# ---------------------------------------------------------------------------------------
# Kernels (built on first use, one per op and dtype)
# ---------------------------------------------------------------------------------------


@functools.cache
def _half_words(kind: str, opcode: int) -> tuple[Any, Any, Any]:
    """Device functions over 32-bit words of two halves of ``kind``: ``reduce(a, b)`` (each
    half combined in float32 and rounded once), ``scale(a, f)`` (``opcode`` PRODUCT or
    DIVIDE) and ``pack(x, y)`` (two float32 rounded into one word, ``x`` low)."""
    from numba import cuda

    load, high, store = half_functions(kind, opcode)
    combine = op_function(opcode)
    u32 = np.uint32

    @cuda.jit(device=True)
    def pack(x, y):  # type: ignore[no-untyped-def]
        return u32(store(x) | u32(store(y) << u32(16)))

    @cuda.jit(device=True)
    def reduce_word(a, b):  # type: ignore[no-untyped-def]
        return pack(combine(load(a), load(b)), combine(high(a), high(b)))

    @cuda.jit(device=True)
    def scale_word(a, f):  # type: ignore[no-untyped-def]
        return pack(combine(load(a), f), combine(high(a), f))

    return reduce_word, scale_word, pack


@functools.cache
def reduce_kernel(kind: str, opcode: int) -> Any:
    """``dst[i] = op(dst[i], src[i])`` for a float32 (``kind="float32"``) or half array
    (``"float16"``, ``"bfloat16"``: uint16 bits, combined in float32, rounded once)."""
    load4, store4 = lanes()
    combine = op_function(opcode)
    if kind == "float32":

        def reduce_f32x4(dst, src):  # type: ignore[no-untyped-def]
            n = dst.shape[0]
            whole, start, stride = n // 4, cuda.grid(1), cuda.gridsize(1)
            v = start
            while v < whole:
                i = v * 4
                a0, a1, a2, a3 = load4(dst, i)
                b0, b1, b2, b3 = load4(src, i)
                store4(dst, i, combine(a0, b0), combine(a1, b1), combine(a2, b2), combine(a3, b3))
                v += stride
            tail = whole * 4 + start
            if tail < n:
                dst[tail] = combine(dst[tail], src[tail])

        return jit_kernel(reduce_f32x4)

    load, _, store = half_functions(kind, opcode)
    word = _half_words(kind, opcode)[0]

    def reduce_half_x8(dst, src):  # type: ignore[no-untyped-def]
        n = dst.shape[0]
        whole, start, stride = n // 8, cuda.grid(1), cuda.gridsize(1)
        v = start
        while v < whole:
            i = v * 8
            a0, a1, a2, a3 = load4(dst, i)
            b0, b1, b2, b3 = load4(src, i)
            store4(dst, i, word(a0, b0), word(a1, b1), word(a2, b2), word(a3, b3))
            v += stride
        tail = whole * 8 + start
        if tail < n:
            dst[tail] = store(combine(load(dst[tail]), load(src[tail])))

    return jit_kernel(reduce_half_x8)


@functools.cache
def scale_kernel(kind: str, opcode: int) -> Any:
    """``dst[i] = dst[i] * factor`` (or ``/``) in float32, for float32 or half arrays."""
    load4, store4 = lanes()
    combine = op_function(opcode)
    if kind == "float32":

        def scale_f32x4(dst, factor):  # type: ignore[no-untyped-def]
            f = np.float32(factor)
            n = dst.shape[0]
            whole, start, stride = n // 4, cuda.grid(1), cuda.gridsize(1)
            v = start
            while v < whole:
                i = v * 4
                a0, a1, a2, a3 = load4(dst, i)
                store4(dst, i, combine(a0, f), combine(a1, f), combine(a2, f), combine(a3, f))
                v += stride
            tail = whole * 4 + start
            if tail < n:
                dst[tail] = combine(dst[tail], f)

        return jit_kernel(scale_f32x4)

    load, _, store = half_functions(kind, opcode)
    word = _half_words(kind, opcode)[1]

    def scale_half_x8(dst, factor):  # type: ignore[no-untyped-def]
        f = np.float32(factor)
        n = dst.shape[0]
        whole, start, stride = n // 8, cuda.grid(1), cuda.gridsize(1)
        v = start
        while v < whole:
            i = v * 8
            a0, a1, a2, a3 = load4(dst, i)
            store4(dst, i, word(a0, f), word(a1, f), word(a2, f), word(a3, f))
            v += stride
        tail = whole * 8 + start
        if tail < n:
            dst[tail] = store(combine(load(dst[tail]), f))

    return jit_kernel(scale_half_x8)


@functools.cache
def cast_kernel(src_name: str, dst_name: str) -> Any:
    """float32 <-> float16/bfloat16, eight elements a turn: one vector of halves and two
    of float32."""
    load4, store4 = lanes()
    half = src_name if src_name != "float32" else dst_name
    prefix = "f16" if half == "float16" else "bf16"
    functions = halves()
    load, high, store = functions[f"{prefix}_widen"], functions[f"{prefix}_widen_high"], functions[f"{prefix}_store"]
    if src_name == half:

        def widen_x8(dst, src):  # type: ignore[no-untyped-def]
            n = dst.shape[0]
            whole, start, stride = n // 8, cuda.grid(1), cuda.gridsize(1)
            v = start
            while v < whole:
                i = v * 8
                w0, w1, w2, w3 = load4(src, i)
                store4(dst, i, load(w0), high(w0), load(w1), high(w1))
                store4(dst, i + 4, load(w2), high(w2), load(w3), high(w3))
                v += stride
            tail = whole * 8 + start
            if tail < n:
                dst[tail] = load(src[tail])

        return jit_kernel(widen_x8)

    pack = _half_words(half, 0)[2]

    def narrow_x8(dst, src):  # type: ignore[no-untyped-def]
        n = dst.shape[0]
        whole, start, stride = n // 8, cuda.grid(1), cuda.gridsize(1)
        v = start
        while v < whole:
            i = v * 8
            a0, a1, a2, a3 = load4(src, i)
            b0, b1, b2, b3 = load4(src, i + 4)
            store4(dst, i, pack(a0, a1), pack(a2, a3), pack(b0, b1), pack(b2, b3))
            v += stride
        tail = whole * 8 + start
        if tail < n:
            dst[tail] = store(src[tail])

    return jit_kernel(narrow_x8)
