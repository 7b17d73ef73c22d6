"""The one JIT decorator of ferrodist and the bit-cast intrinsics the kernels share.

Every CPU kernel is compiled with ``cache=True`` (compiled code is kept on disk,
so a second process starts warm) and ``nogil=True`` (a kernel running in one
rank's thread never blocks another rank's thread).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.core import caching, sigutils
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import intrinsic

if os.environ.get("FERRODIST_GC_FREEZE", "1") != "0":
    # Numba and LLVM leave some 10^5 long-lived objects behind their import. Moved to the
    # collector's permanent generation, they are no longer walked by every full collection
    # while training nor by the two at interpreter exit (0.15-0.3 s of each rank's exit
    # here). Only the objects that exist now are frozen; FERRODIST_GC_FREEZE=0 leaves them.
    gc.freeze()

__all__ = ["bits_from_f32", "copy_into", "f32_from_bits", "jit", "load_acquire", "store_release"]


def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``numba.njit`` with ferrodist's defaults (``cache=True, nogil=True``), its on-disk
    cache made safe for processes that compile at the same time (see :class:`SafeCache`)."""
    options.setdefault("cache", True)
    options.setdefault("nogil", True)
    if fn is None:
        return lambda f: jit(f, **options)
    dispatcher = numba.njit(**options)(fn)
    if options["cache"]:
        dispatcher._cache = SafeCache(dispatcher.py_func)
    dispatcher.compile = functools.partial(_quietly, dispatcher.compile)
    return dispatcher


def _quietly(compile: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Compile without Numba's ``NumbaIRAssumptionWarning``: inlining the op-generic
    ``combine`` into a loop trips one of its internal pedantic checks ("variable ... is not
    in scope ... please report this bug"), about a hundred lines per rank on the first
    bfloat16 all_reduce over shared memory, for code whose results the tests check bit for
    bit. Other warnings pass, and other threads' compiles warn as usual.

    ``warnings.catch_warnings`` would swap the process's filters, and a compile on the
    background thread (``background``) would then undo the filters another thread set
    meanwhile (a test's ``pytest.warns``); instead the one module that issues the warning
    (``numba.core.ssa``) gets a ``warnings`` that drops it while this thread compiles."""
    from numba.core import ssa  # imported here: a module Numba itself loads when it compiles

    if not isinstance(ssa.warnings, _SsaWarnings):
        ssa.warnings = _SsaWarnings()  # type: ignore[assignment]
    depth = _compiling.depth
    _compiling.depth = depth + 1
    try:
        return compile(*args, **kwargs)
    finally:
        _compiling.depth = depth


class _Depth(threading.local):
    """How deep this thread is in compiles of ferrodist's functions."""

    depth = 0


_compiling = _Depth()


class _SsaWarnings:
    """``warnings`` for ``numba.core.ssa``: drops ``NumbaIRAssumptionWarning`` in a thread
    that compiles one of ferrodist's functions, passes everything else on."""

    def __getattr__(self, name: str) -> Any:
        return getattr(warnings, name)

    def warn(self, message: Any, category: Any = None, stacklevel: int = 1, source: Any = None, **more: Any) -> None:
        if isinstance(message, NumbaIRAssumptionWarning) and _compiling.depth:
            return
        warnings.warn(message, category, stacklevel + 1, source, **more)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock shared by every process, on ``path + ".lock"`` (none if the
    directory does not exist or cannot be written: then there is no cache to race on; none
    on Windows, which has no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class LockedCacheFile(caching.IndexDataCacheFile):
    """Numba's per-function cache file (an index of signature -> data file, and the data
    files), read and written under a lock shared by processes.

    Numba saves an entry by reading the index, picking the first free data file number,
    writing the index and then the data, with nothing held in between: two processes that
    compile two signatures of one function at once (ranks starting together on an empty
    cache) can both pick number 1, and the index can end up naming a file that holds the
    other signature's code. A later process then runs that code on its arguments: seen here
    as ``TypeError: can't unbox array`` when the shapes differ, and it would be silent wrong
    results when only the dtype differs. Holding the lock across each save and load makes
    every entry consistent.
    """

    def save(self, key: Any, data: Any) -> None:
        with _locked(self._index_path):
            super().save(key, data)

    def load(self, key: Any) -> Any:
        with _locked(self._index_path):
            return super().load(key)


class SafeCache(caching.FunctionCache):
    """Numba's function cache over a :class:`LockedCacheFile`, which also refuses a loaded
    entry compiled for other argument types than asked (a cache written by an unlocked
    process may hold one): the function is then compiled afresh, as on a miss."""

    def __init__(self, py_func: Callable[..., Any]) -> None:
        super().__init__(py_func)
        self._cache_file.__class__ = LockedCacheFile

    def _index_key(self, sig: Any, codegen: Any) -> Any:
        """Numba's key (signature, machine, the function's bytecode and closure) and the
        source of core's kernels: a cached caller carries a copy of every kernel it calls
        (shm's pipelines call core's fold kernels), and Numba keys an entry on the caller's
        own source only, so a caller cached before the kernels changed would keep running
        the old kernels' code."""
        return (*super()._index_key(sig, codegen), _kernels_stamp())

    def holds(self, sig: Any, target_context: Any) -> bool:
        """Whether the disk cache has code for ``sig`` (argument types) now, without loading
        it: the entry's key is in the function's index (read under the index's lock)."""
        key = self._index_key(sig, target_context.codegen())
        cache_file = self._cache_file
        try:
            with _locked(cache_file._index_path):
                return key in cache_file._load_index()
        except Exception:  # an unreadable index is a miss, as Numba treats it
            return False

    def compile_lock(self) -> contextlib.AbstractContextManager[None]:
        """Held by every process of this host that compiles this function into this cache, so
        that ranks starting together compile it once: the others wait, then load it."""
        return _locked(self._cache_file._index_path + ".compile")

    def _load_overload(self, sig: Any, target_context: Any) -> Any:
        loaded = super()._load_overload(sig, target_context)
        if loaded is not None:
            args, _ = sigutils.normalize_signature(sig)
            if tuple(loaded.signature.args) != tuple(args):
                return None
        return loaded


@functools.cache
def _kernels_stamp() -> str:
    """A digest of the sources every cached kernel may carry: this module and ``_kernels``."""
    digest = hashlib.sha256()
    here = Path(__file__)
    for path in (here, here.parent.parent / "_kernels.py"):
        digest.update(path.read_bytes())
    return digest.hexdigest()


@intrinsic
def f32_from_bits(typingctx: Any, bits: Any) -> Any:
    """Reinterpret the low 32 bits of an integer as a float32 (no conversion)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        value = args[0]
        width = bits.bitwidth  # type: ignore[attr-defined]
        if width > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif width < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return sig, codegen


@intrinsic
def bits_from_f32(typingctx: Any, value: Any) -> Any:
    """Reinterpret a float32 as its 32 bits, returned as an int64 in 0 .. 2**32-1."""
    if value != types.float32:
        return None
    sig = types.int64(value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        as_int = builder.bitcast(args[0], ir.IntType(32))
        return builder.zext(as_int, ir.IntType(64))

    return sig, codegen


def _element_pointer(context: Any, builder: Any, signature: Any, args: Any) -> Any:
    from numba.core import cgutils

    array_type = signature.args[0]
    array = context.make_array(array_type)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, array_type, array, [args[1]], wraparound=False)


@intrinsic
def load_acquire(typingctx: Any, array: Any, index: Any) -> Any:
    """Atomic load (acquire) of ``array[index]`` for a uint64 array: never hoisted out of a
    spin loop, and later reads cannot move before it (words shared between processes)."""
    if not (isinstance(array, types.Array) and array.dtype == types.uint64 and isinstance(index, types.Integer)):
        return None
    sig = types.uint64(array, index)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.load_atomic(_element_pointer(context, builder, signature, args), "acquire", 8)

    return sig, codegen


@intrinsic
def store_release(typingctx: Any, array: Any, index: Any, value: Any) -> Any:
    """Atomic store (release) to ``array[index]`` of a uint64 array: earlier writes (the
    data it announces) are visible to any process that sees this value."""
    if not (isinstance(array, types.Array) and array.dtype == types.uint64 and isinstance(index, types.Integer)):
        return None
    sig = types.void(array, index, value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        word = context.cast(builder, args[2], signature.args[2], types.uint64)
        builder.store_atomic(word, _element_pointer(context, builder, signature, args), "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def copy_into(typingctx: Any, dst: Any, src: Any) -> Any:
    """``dst[:] = src`` for one-dimensional C-contiguous arrays of one dtype and length, as one
    ``memcpy`` (Numba's own slice assignment is an element loop). The caller checks lengths."""
    if not (
        isinstance(dst, types.Array)
        and isinstance(src, types.Array)
        and dst.ndim == src.ndim == 1
        and dst.layout == src.layout == "C"
        and dst.dtype == src.dtype
    ):
        return None
    sig = types.void(dst, src)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        from numba.core import cgutils

        out = context.make_array(signature.args[0])(context, builder, args[0])
        inp = context.make_array(signature.args[1])(context, builder, args[1])
        nbytes = builder.mul(inp.nitems, inp.itemsize)
        cgutils.raw_memcpy(builder, out.data, inp.data, nbytes, 1)
        return context.get_dummy_value()

    return sig, codegen


def _hardware_half() -> bool:
    """Whether LLVM turns float16 <-> float32 conversions into instructions here (x86 with
    F16C, or AArch64); elsewhere they would be calls to runtime helpers Numba does not link."""
    import platform

    from llvmlite import binding

    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    try:
        return bool(binding.get_host_cpu_features().get("f16c", False))
    except RuntimeError:
        return False


#: True where the kernels convert float16 with the CPU's own instructions (vectorised, and
#: exact both ways, rounding to nearest-even); the software conversions stay for the rest.
HARDWARE_HALF = _hardware_half()


@intrinsic
def f32_from_f16_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 value of float16 bits (exact), with the CPU's conversion instruction."""
    if bits != types.uint16:
        return None
    sig = types.float32(bits)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def f16_bits_from_f32(typingctx: Any, value: Any) -> Any:
    """float32 rounded to the nearest float16 (ties to even, overflow to inf), as its bits."""
    if value != types.float32:
        return None
    sig = types.uint16(value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen
