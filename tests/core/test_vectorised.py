"""The vectorisation gate: every reduction kernel's element loop compiles to packed SIMD.

Compile-only (no timing): for every (dtype, op) of the kernel table and k = 2, 4, 8 sources,
the kernel's machine code (``inspect_asm``) must hold packed instructions on wide vector
registers: ymm or zmm where the CPU has AVX2 (LLVM picks 512-bit zmm on some AVX-512 CPUs
and keeps 256-bit ymm on others), xmm otherwise. A kernel that falls back to a
scalar loop (a run-time op switch, an unresolved aliasing check, an opaque call) has none,
and fails here on any x86-64 machine, however fast or slow that machine is.
"""

from __future__ import annotations

import platform
import re

import numpy as np
import pytest
from numba import typeof, types

from ferrodist.core import ALL_DTYPES, ReduceOp, dtype
from ferrodist.core.kernels import combine, fold_kernel, jit, plan

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason=f"the gate reads x86-64 machine code; this CPU is {platform.machine()}")


def _host_has(feature: str) -> bool:
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get(feature, False))


#: The vector registers a vectorised loop must use here (a regex alternative).
REGISTER = "[yz]mm" if X86 and _host_has("avx2") else "xmm"
#: Packed arithmetic (p-suffixed floating point, p-prefixed integer SIMD, conversions of
#: packed halves) on vector registers; scalar ones (``addss``...) end in s[sd] and never
#: match, nor do moves (a spill of a vector register is not a vectorised loop).
PACKED = re.compile(r"^\s*(?!v?mov)v?(p[a-z]+[bwdq]?|[a-z]+p[sd]|cvtph2ps|cvtps2ph)\s+.*%" + REGISTER + r"\d+")
#: op -> (packed float instructions it must use, ones it must not)
ONLY = {
    ReduceOp.SUM: ({"addp"}, {"mulp", "divp", "cmpp", "blendvp"}),
    ReduceOp.AVG: ({"addp", "divp"}, {"mulp", "cmpp", "blendvp"}),
    ReduceOp.PRODUCT: ({"mulp"}, {"addp", "divp", "cmpp", "blendvp"}),
}
PAIRS = [(dt, op) for dt in ALL_DTYPES for op in sorted(dt.ops, key=lambda o: o.value)]


def packed_lines(kernel, storage, k):
    """The packed-SIMD lines of ``kernel`` compiled for k sources of numpy dtype ``storage``
    (compiled afresh from its source: Numba shows no machine code for cached kernels)."""
    fresh = jit(cache=False)(kernel.py_func)
    array = typeof(np.empty(1, storage))
    sig = (array, types.UniTuple(array, k), types.float64)
    fresh.compile(sig)
    return [line for line in fresh.inspect_asm(sig).splitlines() if PACKED.search(line)]


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=[f"{d.name}-{o.name}" for d, o in PAIRS])
def test_every_kernel_is_vectorised(dt, op):
    kind, view, opcode = plan(dt, op)
    kernel = fold_kernel(kind, opcode, op is ReduceOp.AVG, -1)
    for k in (2, 4, 8):
        lines = packed_lines(kernel, dt.numpy if view is None else view, k)
        assert len(lines) >= 2, f"{dt.name} {op.name} k={k}: no packed {REGISTER} instructions in the kernel"
        if dt.name in ("float32", "float64") and op in ONLY:
            # One op compiled, not a blend of all four (what a run-time op switch gives).
            found = {m for line in lines for m in re.findall(r"v?(addp|mulp|divp|cmpp|blendvp)[sd]", line)}
            want, banned = ONLY[op]
            assert want <= found and not (banned & found), f"{dt.name} {op.name} k={k}: packed {sorted(found)}"


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("name", ["float32", "bfloat16", "int64"])
def test_in_place_kernels_are_vectorised(name, position):
    """The destination as the first or second source (what the collectives pass)."""
    dt = dtype(name)
    kind, view, opcode = plan(dt, ReduceOp.SUM)
    for k in (2, 4):
        lines = packed_lines(fold_kernel(kind, opcode, False, position), dt.numpy if view is None else view, k)
        assert len(lines) >= 2, f"{name} in place at {position}, k={k}: not vectorised"


def test_the_gate_catches_a_scalar_loop():
    """A loop LLVM cannot vectorise (each element depends on the previous) has no packed line."""

    @jit(cache=False)
    def prefix(dst, srcs, divisor):  # type: ignore[no-untyped-def]
        a = srcs[0]
        acc = a[0]
        for i in range(dst.shape[0]):
            acc = acc * a[i] + 1.0
            dst[i] = acc

    assert packed_lines(prefix, np.float32, 2) == []


def test_the_gate_catches_a_run_time_op():
    """With the op read at run time, LLVM computes every op and blends (the regression the
    gate is for): packed multiplies and blends appear where only adds belong."""

    @jit(cache=False)
    def any_op(dst, srcs, divisor):  # type: ignore[no-untyped-def]
        op = np.int64(divisor)
        for u in range(np.uint64(0), np.uint64(dst.shape[0])):
            acc = srcs[0][u]
            for s in range(1, len(srcs)):
                acc = combine(acc, srcs[s][u], op)
            dst[u] = acc

    lines = packed_lines(any_op, np.float32, 4)
    found = {m for line in lines for m in re.findall(r"v?(addp|mulp|divp|cmpp|blendvp)[sd]", line)}
    assert found & ONLY[ReduceOp.SUM][1], found


def test_the_shared_memory_loops_round_and_widen_bfloat16_in_packed_simd():
    """``all_reduce(compress="bf16")`` over shared memory rounds float32 into the slots, folds
    two ranks' data with this rank's rounded on the fly, and widens the result back: each
    of those loops must be packed (a scalar one made the compressed call slower than the
    float32 one it replaces)."""
    halves = pytest.importorskip("ferrodist.transport._shm.halves")

    @jit(cache=False)
    def move(dst, src):  # type: ignore[no-untyped-def]
        halves.move(dst, src)

    @jit(cache=False)
    def pair(out, mine, other, divisor):  # type: ignore[no-untyped-def]
        halves.fold_rounded_pair(out, mine, other, divisor)

    bits, values = typeof(np.empty(1, np.uint16)), typeof(np.empty(1, np.float32))
    for kernel, sig, must in [
        (move, (bits, values), set()),  # rounded into a slot
        (move, (values, bits), set()),  # widened out of one
        (pair, (bits, values, bits, types.float64), {"addp", "divp"}),
    ]:
        kernel.compile(sig)
        lines = [line for line in kernel.inspect_asm(sig).splitlines() if PACKED.search(line)]
        assert len(lines) >= 2, f"{kernel.py_func.__name__}{sig}: no packed {REGISTER} instructions"
        found = {m for line in lines for m in re.findall(r"v?(addp|mulp|divp)[sd]", line)}
        assert must <= found, f"{kernel.py_func.__name__}{sig}: packed {sorted(found)}"
