"""Element-wise reductions: the dispatch table from (dtype, op) to a Numba kernel.

Public: :func:`reduce_into` and :func:`reduce_many` (validate, then call the kernel).
For collective algorithms: :func:`reducer` returns the raw, validated-once callable
``fn(dst, srcs, divisor)`` on flat numpy arrays of the dtype (no per-call checks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._dtypes import ALL_DTYPES, DType, check_op
from ._errors import InvalidArgument
from ._ops import ReduceOp
from ._tensor import Tensor, as_tensor

__all__ = ["MAX_FUSED_SOURCES", "reduce_into", "reduce_many", "reducer"]

#: The most sources one kernel call reads; more are folded in groups of this size.
MAX_FUSED_SOURCES = 8

Array = np.ndarray[Any, Any]
Reducer = Callable[[Array, Sequence[Array], float], None]

# bool is stored as 0/1 bytes, so its ops are the uint8 bitwise ones.
_BOOL_OPCODE = {
    ReduceOp.SUM: ReduceOp.BOR,
    ReduceOp.MAX: ReduceOp.BOR,
    ReduceOp.PRODUCT: ReduceOp.BAND,
    ReduceOp.MIN: ReduceOp.BAND,
}


@functools.cache
def _table() -> dict[tuple[str, ReduceOp], tuple[int, np.dtype[Any] | None, int]]:
    """(dtype name, op) -> (element kind, bit-pattern view dtype or None, opcode).

    The one opcode table of the reductions: the CPU kernels here, the shared-memory
    pipelines (through ``ferrodist.core.kernels.plan``) and the GPU kernels fold with it.
    """
    from . import _kernels as k

    table: dict[tuple[str, ReduceOp], tuple[int, np.dtype[Any] | None, int]] = {}
    for dt in ALL_DTYPES:
        for op in dt.ops:
            opcode = op.combine
            if dt.name in ("float16", "bfloat16"):
                kind = k.BF16 if dt.name == "bfloat16" else k.F16
                table[(dt.name, op)] = (kind, np.dtype(np.uint16), opcode.value)
            elif dt.name == "bool":
                table[(dt.name, op)] = (k.PLAIN, np.dtype(np.uint8), _BOOL_OPCODE.get(op, op).value)
            else:
                table[(dt.name, op)] = (k.PLAIN, None, opcode.value)
    return table


def plan(dt: DType, op: ReduceOp) -> tuple[int, np.dtype[Any] | None, int]:
    """How ``(dt, op)`` is folded: ``(kind, view, opcode)``: the element kind (``PLAIN``,
    ``BF16``, ``F16`` of ``ferrodist.core.kernels``), the dtype to view the arrays as first
    (uint16 bits for the 16-bit floats, uint8 for bool; None: as they are) and the opcode
    (AVG folds as SUM; bool's SUM/MAX as BOR, PRODUCT/MIN as BAND). The caller has checked
    the op with ``check_op``."""
    return _table()[(dt.name, op)]


def pairwise_opcode(dt: DType, op: ReduceOp) -> tuple[np.dtype[Any] | None, int] | None:
    """For code that folds sources two at a time in the array's own precision (and so gets
    the same bits as the kernels): the view to apply first (bool as uint8, else None) and the
    opcode. None for float16/bfloat16, whose kernels accumulate in float32 and round once."""
    kind, view, opcode = plan(dt, op)
    return None if kind else (view, opcode)


def _position(dst: Array, srcs: Sequence[Array]) -> int:
    """-1: ``dst`` shares no memory with a source; j: it is exactly source j (the first such);
    -2: it overlaps a source otherwise."""
    for j, s in enumerate(srcs):
        if s is dst:
            return j
    found = -1
    for j, s in enumerate(srcs):
        if np.may_share_memory(dst, s):
            same = s.__array_interface__["data"][0] == dst.__array_interface__["data"][0] and s.shape == dst.shape
            if not same:
                return -2
            if found < 0:
                found = j
    return found


@functools.cache
def reducer(dt: DType, op: ReduceOp) -> Reducer:
    """The kernel for ``(dt, op)`` as ``fn(dst, srcs, divisor)``.

    ``dst`` and every source are one-dimensional numpy arrays of ``dt`` with the same
    length; ``dst`` may be one of the sources (the first or second has a compiled variant
    of its own; a later one, or a partial overlap, goes through a temporary). ``divisor`` divides the combined value before its rounding (pass ``1.0``
    except for AVG; integer kernels ignore it). AVG combines as SUM: the caller chooses the
    divisor (the number of ranks). The caller has checked the op with ``check_op``.

    A call never compiles: the first call with new array types (dtype, layout, number of
    sources) queues the kernel's compile on the background thread and folds with numpy
    (``_interpreted``, the same bits) until the kernel is ready.
    """
    kind, view, opcode = plan(dt, op)
    floating = dt.is_floating
    twins: dict[tuple[bool, int], Any] = {}

    def apply(dst: Array, srcs: tuple[Array, ...], divisor: float, position: int) -> None:
        divide = floating and divisor != 1.0
        twin = twins.get((divide, position))
        if twin is None:
            twin = twins[(divide, position)] = fold_twin(kind, opcode, divide, position)
        twin(dst, srcs, divisor)

    def fold(dst: Array, srcs: Sequence[Array], divisor: float) -> None:
        """At most MAX_FUSED_SOURCES sources."""
        position = _position(dst, srcs)
        if position == -2 or position > 1:  # rare: not worth a compiled variant of its own
            tmp = np.empty_like(dst)
            apply(tmp, tuple(srcs), divisor, -1)
            dst[...] = tmp
            return
        apply(dst, tuple(srcs), divisor, position)

    def run(dst: Array, srcs: Sequence[Array], divisor: float) -> None:
        if view is not None:
            dst = dst.view(view)
            srcs = [s.view(view) for s in srcs]
        rest = srcs[MAX_FUSED_SOURCES:]
        if not rest:
            fold(dst, srcs, divisor)
            return
        # More sources than one kernel reads: fold them in groups, dividing only at the end.
        target = dst
        if any(np.may_share_memory(dst, s) for s in rest):
            target = np.empty_like(dst)  # dst is read later: accumulate elsewhere first
        fold(target, srcs[:MAX_FUSED_SOURCES], 1.0)
        while rest:
            group, rest = rest[: MAX_FUSED_SOURCES - 1], rest[MAX_FUSED_SOURCES - 1 :]
            fold(target, (target, *group), 1.0 if rest else divisor)
        if target is not dst:
            dst[...] = target

    return run


def _flat_operands(dst: object, srcs: Sequence[object], operation: str) -> tuple[Tensor, list[Tensor]]:
    out = as_tensor(dst)
    ins = [as_tensor(s) for s in srcs]
    if not ins:
        raise InvalidArgument(f"{operation}: needs at least one source array")
    if not out.writeable:
        raise InvalidArgument(f"{operation}: the destination array is read-only")
    for i, t in enumerate(ins):
        if t.dtype is not out.dtype:
            raise InvalidArgument(
                f"{operation}: source {i} is {t.dtype.name} but the destination is {out.dtype.name}; "
                "convert first (reductions never mix dtypes)"
            )
        if t.numel != out.numel:
            raise InvalidArgument(f"{operation}: source {i} has {t.numel} elements but the destination has {out.numel}")
    return out, ins


def reduce_many(dst: object, srcs: Sequence[object], op: ReduceOp | str = ReduceOp.SUM) -> None:
    """Write the element-wise reduction of all ``srcs`` into ``dst``, reading each source once.

    One fused pass over k sources moves k+1 buffers through memory, where chaining
    pairwise numpy calls moves 3(k-1). ``AVG`` is the mean of the sources. float16 and
    bfloat16 accumulate in float32 and round once. ``dst`` may be one of the sources.

    Example:
        >>> a, b, c = (np.full(3, v, np.float32) for v in (1, 2, 3))
        >>> out = np.empty(3, np.float32)
        >>> reduce_many(out, [a, b, c], ReduceOp.MAX)
        >>> out
        array([3., 3., 3.], dtype=float32)
    """
    op = ReduceOp.coerce(op)
    out, ins = _flat_operands(dst, srcs, "reduce_many")
    check_op(op, out.dtype, operation="reduce_many")
    divisor = op.divisor(len(ins))
    reducer(out.dtype, op)(out.flat(), [t.flat() for t in ins], divisor)


def reduce_into(dst: object, src: object, op: ReduceOp | str = ReduceOp.SUM) -> None:
    """``dst = dst (op) src`` element-wise, in place (``AVG`` gives the mean of the two).

    Example:
        >>> d = np.array([1, 5], np.int32)
        >>> reduce_into(d, np.array([4, 2], np.int32), "min")
        >>> d
        array([1, 2], dtype=int32)
    """
    op = ReduceOp.coerce(op)
    out, ins = _flat_operands(dst, [src], "reduce_into")
    check_op(op, out.dtype, operation="reduce_into")
    divisor = op.divisor(2)
    reducer(out.dtype, op)(out.flat(), [out.flat(), ins[0].flat()], divisor)


@functools.cache
def fold_twin(kind: int, opcode: int, divide: bool, position: int) -> Any:
    """The ``Twin`` of ``fold_kernel(kind, opcode, divide, position)``: the compiled fold,
    or numpy's (``_interpreted.fold``, the same bits) while it compiles."""
    from ._compile.twin import Twin
    from ._interpreted import fold
    from ._kernels import fold_kernel

    return Twin(fold_kernel(kind, opcode, divide, position), functools.partial(fold, kind, opcode, divide))
