"""The wide kernels' PTX for an H100 (compute capability 9.0), compiled without a GPU.

No machine that runs the tests can time a kernel, so this reads what the compiler made of
the kernels that ``reduce_into``, ``scale`` and ``cast`` launch for aligned float32,
float16 and bfloat16 arrays (the kernels of ``ferrodist.gpu._cuda_vector``):

- 16-byte vector accesses: ``ld.global.v4`` (``.nc`` allowed) and ``st.global.v4`` of
  ``f32``/``u32``/``b32``, as torch's elementwise kernels use; an 8-byte or element-wise
  kernel moves the same bytes in two to eight times as many memory instructions;
- no 64-bit integer operation on the data path. The data path is every instruction that
  loads from global memory or reads a register that such an instruction wrote, however
  indirectly (a fixed point over the kernel's registers, so it follows values through
  conversions, selects and predicates); none of them may have a 64-bit integer type
  (``.s64``, ``.u64``, ``.b64``, or ``.wide`` of 32-bit operands, which makes one). A GPU does such an
  operation as two or more 32-bit ones, and a half kernel does several per element.
  Addresses, loop counters and sizes are 64-bit and are not on the data path;
- no ``call``: every device function is inlined (and the data path above is complete);
- IEEE arithmetic on the data path, no ``.ftz`` or ``.approx`` (bit-identity with the CPU
  kernels needs subnormals kept and a correctly rounded division).

A kernel built the previous way (8-byte loads as uint64, halves unpacked with uint64 and
int64 shifts and masks) fails the first two checks.

The pytest process runs Numba's CUDA simulator (tests/gpu/conftest.py), so the PTX is
compiled in a subprocess started with ``NUMBA_ENABLE_CUDASIM=0`` (numba reads the variable
at its first import). Compiling needs NVVM and NVRTC (the wheels nvidia-nvvm and
nvidia-cuda-nvrtc, CUDA 13, in ferrodist-gpu's test extra) but no GPU: numba-cuda compiles
a device function for the current device's compute capability, so the subprocess names
9.0 for it. Without the wheels the PTX tests skip and say what to install.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ferrodist.core import ReduceOp, Tensor

pytest.importorskip("ferrodist.gpu", reason="ferrodist-gpu is not installed (pip install packages/gpu)")
from ferrodist.gpu import _cuda_kernels as kernels
from ferrodist.gpu import _cuda_vector as vector

WIDE = ("float32", "bfloat16", "float16")
OPS = ("SUM", "PRODUCT", "MIN", "MAX")
INSTALL = (
    "install the CUDA 13 compiler wheels to compile PTX without a GPU: "
    "pip install 'nvidia-cuda-nvrtc>=13,<14' 'nvidia-nvvm>=13,<14' (ferrodist-gpu's test extra has them)"
)

_COMPILE = textwrap.dedent(
    """
    import json, sys

    def missing():
        try:
            from numba.cuda.cudadrv import nvvm
            if not nvvm.is_available():
                return "libNVVM is not available"
            nvvm.NVVM()
        except Exception as exc:
            return f"libNVVM: {type(exc).__name__}: {exc}"
        try:
            from numba.cuda.cudadrv import nvrtc
            nvrtc._get_nvrtc_version()
        except Exception as exc:
            return f"NVRTC: {type(exc).__name__}: {exc}"
        return None

    reason = missing()
    if reason is not None:
        print(json.dumps({"missing": reason}))
        sys.exit(0)

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda, float32, uint16

    class H100:  # device functions are compiled for the current device's capability
        compute_capability = (9, 0)

    if not hasattr(dispatcher, "get_current_device"):
        sys.exit("numba.cuda.dispatcher no longer calls get_current_device: update tests/gpu/test_ptx.py")
    dispatcher.get_current_device = H100

    from ferrodist.core.kernels import MAX, MIN, PRODUCT, SUM
    from ferrodist.gpu import _cuda_device, _cuda_vector as vector

    def storage(kind):
        return float32[::1] if kind == "float32" else uint16[::1]

    def ptx(kernel, argtypes):
        text, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0))
        return text

    out = {}
    ops = {"SUM": SUM, "PRODUCT": PRODUCT, "MIN": MIN, "MAX": MAX}
    for kind in ("float32", "bfloat16", "float16"):
        array = storage(kind)
        for name, opcode in ops.items():
            out[f"reduce {kind} {name}"] = ptx(vector.reduce_kernel(kind, opcode), (array, array))
        for name, opcode in (("multiply", PRODUCT), ("divide", _cuda_device.DIVIDE)):
            out[f"scale {kind} {name}"] = ptx(vector.scale_kernel(kind, opcode), (array, float32))
    for half in ("bfloat16", "float16"):
        out[f"cast float32->{half}"] = ptx(vector.cast_kernel("float32", half), (uint16[::1], float32[::1]))
        out[f"cast {half}->float32"] = ptx(vector.cast_kernel(half, "float32"), (float32[::1], uint16[::1]))
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    """PTX text of every wide kernel, by ``"<function> <dtype> <op>"``."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "missing" in result:
        pytest.skip(f"{result['missing']}; {INSTALL}")
    return result


# --- reading PTX ------------------------------------------------------------------------------

_REGISTER = re.compile(r"%[a-z]+\d+")
_INT64 = {"s64", "u64", "b64"}


def is_int64(opcode: str) -> bool:
    """A 64-bit integer type, or ``.wide`` of 32-bit operands (whose result is 64-bit)."""
    parts = set(opcode.split("."))
    return bool(_INT64 & parts) or ("wide" in parts and bool({"s32", "u32"} & parts))


def instructions(ptx: str) -> list[tuple[str, list[str], list[str]]]:
    """The kernel's instructions as ``(opcode, written registers, read registers)``, the
    guard predicate of a guarded instruction among those read."""
    body = ptx[ptx.index(".entry") :]
    body = body[body.index("{") + 1 : body.rindex("}")]
    found = []
    for raw in body.splitlines():
        line = raw.split("//")[0].strip()
        if not line.endswith(";") or line.startswith("."):
            continue
        guard = []
        if line.startswith("@"):
            predicate, line = line.split(None, 1)
            guard = _REGISTER.findall(predicate)
        opcode, _, rest = line.rstrip(";").partition(" ")
        operands = _split_operands(rest)
        if opcode.startswith(("st.", "bra", "ret", "bar", "call", "exit")) or not operands:
            written, read = [], _REGISTER.findall(rest)
        else:
            written, read = _REGISTER.findall(operands[0]), _REGISTER.findall(",".join(operands[1:]))
        found.append((opcode, written, read + guard))
    return found


def _split_operands(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    return parts


def data_path(ptx: str) -> list[str]:
    """The opcodes (with their registers) of every instruction on the data path: global
    loads, and whatever reads a register they wrote, to a fixed point."""
    code = instructions(ptx)
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for opcode, written, read in code:
            if opcode.startswith("ld.global") or tainted.intersection(read):
                new = set(written) - tainted
                if new:
                    tainted |= new
                    changed = True
    return [
        f"{opcode} {' '.join(written)} <- {' '.join(read)}"
        for opcode, written, read in code
        if opcode.startswith("ld.global") or tainted.intersection(read)
    ]


def int64_on_data_path(ptx: str) -> list[str]:
    return [line for line in data_path(ptx) if is_int64(line.split()[0])]


def test_the_reader_finds_a_64_bit_data_path_and_ignores_64_bit_addresses():
    ptx = """
    .visible .entry k(.param .u64 a)
    {
        ld.param.u64 %rd1, [a];
        mul.wide.s32 %rd2, %r1, 8;
        add.s64 %rd3, %rd1, %rd2;
        ld.global.v4.u32 {%r2, %r3, %r4, %r5}, [%rd3];
        cvt.u64.u32 %rd4, %r2;
        shl.b32 %r6, %r3, 16;
        @%p1 bra $L__BB0_2;
        setp.gt.u32 %p2, %r6, 7;
        selp.b32 %r7, %r6, %r4, %p2;
        st.global.v4.u32 [%rd3], {%r7, %r3, %r4, %r5};
    }
    """
    path = data_path(ptx)
    assert [line.split()[0] for line in path] == ["ld.global.v4.u32", "cvt.u64.u32", "shl.b32", "setp.gt.u32",
                                                  "selp.b32", "st.global.v4.u32"]  # fmt: skip
    assert int64_on_data_path(ptx) == ["cvt.u64.u32 %rd4 <- %r2"]


# --- the gate ---------------------------------------------------------------------------------

_VECTOR_LOAD = re.compile(r"\bld\.global(?:\.nc)?\.v4\.(?:f32|u32|b32)\b")
_VECTOR_STORE = re.compile(r"\bst\.global\.v4\.(?:f32|u32|b32)\b")


def _names() -> list[str]:
    names = [f"reduce {kind} {op}" for kind in WIDE for op in OPS]
    names += [f"scale {kind} {how}" for kind in WIDE for how in ("multiply", "divide")]
    return names + [f"cast {a}->{b}" for h in ("bfloat16", "float16") for a, b in (("float32", h), (h, "float32"))]


@pytest.mark.parametrize("name", _names())
def test_wide_kernels_move_16_bytes_per_access_with_32_bit_data(compiled, name):
    ptx = compiled[name]
    problems = []
    if not _VECTOR_LOAD.search(ptx):
        problems.append("no ld.global.v4 of 32-bit lanes")
    if not _VECTOR_STORE.search(ptx):
        problems.append("no st.global.v4 of 32-bit lanes")
    if "call" in [opcode.split(".")[0] for opcode, _, _ in instructions(ptx)]:
        problems.append("a device function is called, not inlined")
    inexact = [line for line in data_path(ptx) if {"ftz", "approx"} & set(line.split()[0].split("."))]
    if inexact:
        problems.append("flush-to-zero or approximate arithmetic on the data path: " + "; ".join(inexact[:4]))
    wide = int64_on_data_path(ptx)
    if wide:
        problems.append(
            f"{len(wide)} 64-bit integer operations on the data path, the first ones:\n  " + "\n  ".join(wide[:12])
        )
    if problems:
        pytest.fail(f"{name}: " + "; ".join(problems), pytrace=False)


def test_reduce_into_picks_the_vector_kernels_for_aligned_arrays(cuda, monkeypatch):
    """The kernels above are the ones the public functions launch for aligned float32,
    bfloat16 and float16 arrays (a bfloat16 Tensor over int16 bits too); a view one
    element off a 16-byte boundary goes element by element."""
    launched = []
    real = kernels._launch

    def spy(kernel, n, *args):
        launched.append(kernel)
        return real(kernel, n, *args)

    monkeypatch.setattr(kernels, "_launch", spy)
    for name in WIDE:
        storage = np.float32 if name == "float32" else np.uint16
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
            dst, src = cuda.to_device(np.zeros(24, storage)), cuda.to_device(np.zeros(24, storage))
            kernels.reduce_into(dst, src, name, op)
            opcode = ReduceOp.SUM.value if op is ReduceOp.AVG else op.value
            assert launched.pop() is vector.reduce_kernel(name, opcode), (name, op)
        kernels.reduce_into(dst[1:], src[1:], name)
        assert launched.pop() is kernels._reduce_kernel("plain" if name == "float32" else name, ReduceOp.SUM.value)
        kernels.scale(dst, name, 3.0)
        assert launched.pop() is vector.scale_kernel(name, ReduceOp.PRODUCT.value)
    bits = cuda.to_device(np.zeros(16, np.int16))
    as_bf16 = Tensor.from_device_array(bits, dtype="bfloat16")
    kernels.reduce_into(as_bf16, as_bf16)
    assert launched.pop() is vector.reduce_kernel("bfloat16", ReduceOp.SUM.value)
    kernels.cast(cuda.device_array(16, np.float32), src=as_bf16)
    assert launched.pop() is vector.cast_kernel("bfloat16", "float32")
