"""Kernels called from Python never compile in the caller's thread.

A front (``kernels.background``) runs code already compiled and raises ``NotCompiled`` for
anything else, at once, even while another thread holds Numba's compiler lock; ``reducer``
then folds with numpy (``fold_numpy``), whose bits must be the kernels' for every dtype,
op, source count and place of the destination; the compile runs on one background thread,
which a process may exit or fork under.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from numba import typeof
from numba.core.compiler_lock import global_compiler_lock

from ferrodist.core import ALL_DTYPES, ReduceOp, bfloat16, float32, reducer
from ferrodist.core.kernels import (
    NotCompiled,
    background,
    fold_kernel,
    fold_numpy,
    jit,
    plan,
    prepare,
    wait_for_compiles,
)

RNG_SEED = 20260514


@contextlib.contextmanager
def compiler_busy() -> Iterator[None]:
    """Numba's compiler lock held by another thread for the duration of the block."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with global_compiler_lock:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        yield
    finally:
        release.set()
        holder.join()


def _sources(dt, op, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """k sources of the kernels' element type: every 16-bit pattern for float16/bfloat16 in
    source 0, random bits otherwise (NaNs, infinities and subnormals included), half of the
    float elements ordinary values (so that sums and products are not all NaN)."""
    kind, view, _ = plan(dt, op)
    store = np.dtype(view or dt.numpy)
    if kind:
        n = 1 << 16
        srcs = [rng.integers(0, 1 << 16, n).astype(np.uint16) for _ in range(k)]
        srcs[0] = np.arange(n, dtype=np.uint16)
        for s in srcs[1:]:
            s[: n // 2] = rng.normal(0, 50, n // 2).astype(np.float32).astype(dt.numpy).view(np.uint16)
        return srcs
    n = 4096
    srcs = [rng.integers(0, 256, n * store.itemsize).astype(np.uint8).view(store) for _ in range(k)]
    if dt.name == "bool":
        srcs = [s & 1 for s in srcs]
    if dt.is_floating:
        for s in srcs:
            s[: n // 2] = rng.normal(0, 100, n // 2).astype(store)
    return srcs


CASES = [(dt, op) for dt in ALL_DTYPES for op in sorted(dt.ops, key=lambda o: o.value)]


@pytest.mark.parametrize(("dt", "op"), CASES, ids=[f"{dt.name}-{op.name.lower()}" for dt, op in CASES])
def test_fold_numpy_writes_the_kernels_bits(dt, op):
    """Every (dtype, op), 1 to 3 sources (2 to 4 for the 16-bit floats' patterns), into a
    separate array and in place, dividing or not: byte for byte the compiled kernel's."""
    kind, _, opcode = plan(dt, op)
    rng = np.random.default_rng([RNG_SEED, opcode, kind, len(dt.name)])
    divides = (False, True) if dt.is_floating and op is ReduceOp.AVG else (False,)
    for k in (1, 2, 3):
        srcs = _sources(dt, op, k, rng)
        for divide in divides:
            divisor = float(k) if divide else 1.0
            for position in (-1, 0):
                want_srcs = [srcs[0].copy(), *srcs[1:]]
                got_srcs = [srcs[0].copy(), *srcs[1:]]
                want = want_srcs[0] if position == 0 else np.empty_like(srcs[0])
                got = got_srcs[0] if position == 0 else np.empty_like(srcs[0])
                fold_kernel(kind, opcode, divide, position)(want, tuple(want_srcs), divisor)
                fold_numpy(kind, opcode, divide, got, got_srcs, divisor)
                different = np.flatnonzero(want.view(np.uint8) != got.view(np.uint8))
                assert different.size == 0, (k, divide, position, different[:5])


def test_a_front_without_code_raises_at_once_even_while_the_compiler_is_busy():
    @jit(cache=False)
    def twice(x):  # type: ignore[no-untyped-def]
        for i in range(x.shape[0]):
            x[i] *= 2

    front = background(twice)
    x = np.arange(4, dtype=np.int64)
    twice(x)  # compiled in this thread for int64 arrays (a test may)
    with compiler_busy():  # what a long compile on the background thread does
        start = time.monotonic()
        with pytest.raises(NotCompiled) as missing:
            front(x)  # its dispatcher has the code, the front has not been given it
        with pytest.raises(NotCompiled):
            front(np.zeros(3, np.float32))
        assert time.monotonic() - start < 1.0
        assert missing.value.front is front
        assert len(missing.value.types) == 1
    ticket = prepare([(front, missing.value.types)])
    assert ticket.wait(30) and ticket.failed is None
    assert prepare([(front, missing.value.types)]) is ticket  # asked again: the same ticket
    front(x)  # now it runs
    assert x.tolist() == [0, 4, 8, 12]


def test_code_handed_to_a_front_leaves_a_walk_of_its_table_unharmed():
    """The compiling thread adds code while a caller's thread may be walking the front's
    table (Numba does, looking for conversions, when a call's types match no code): the
    walk must go on. Adding in place raised ``OrderedDict mutated during iteration`` in
    the caller (a chaos schedule hit it in a reduce_scatter)."""

    @jit(cache=False)
    def inc(x):  # type: ignore[no-untyped-def]
        x[0] += 1

    front = background(inc)
    for dtype in (np.int64, np.float64):
        ticket = prepare([(front, (typeof(np.zeros(1, dtype)),))])
        assert ticket.wait(60) and ticket.failed is None
    walk = iter(front.overloads.values())  # what nopython_signatures does, cut in two
    next(walk)
    inc(np.zeros(1, np.int32))  # the dispatcher compiles int32 here
    front.add_overload(inc.overloads[(typeof(np.zeros(1, np.int32)),)])
    assert len(list(walk)) == 1  # the rest of the walk, over the table as it was
    x = np.zeros(1, np.int32)
    front(x)  # and the new code runs
    assert x[0] == 1


def test_compiled_code_runs_while_another_thread_compiles():
    """nogil kernels need neither the compiler lock nor the GIL: a compile holds up no call."""
    fold = reducer(bfloat16, ReduceOp.SUM)
    a = np.ones(1 << 16, bfloat16.numpy)
    fold(a, [a, a], 1.0)
    assert wait_for_compiles(120)
    with compiler_busy():  # what a long compile on the background thread does
        start = time.monotonic()
        for _ in range(20):
            fold(a, [a, a], 1.0)
        assert time.monotonic() - start < 1.0


def test_reducer_folds_with_numpy_while_its_kernel_waits_for_the_compiler():
    """Five sources (a count nothing else compiles), the compiler lock held elsewhere: the
    call returns the kernels' result at once; the kernel arrives once the lock is free."""
    dt, op = float32, ReduceOp.MAX
    kind, _, opcode = plan(dt, op)
    rng = np.random.default_rng(7)
    srcs = [rng.normal(size=1000).astype(dt.numpy) for _ in range(5)]
    with compiler_busy():  # what a long compile on the background thread does
        start = time.monotonic()
        out = np.empty(1000, dt.numpy)
        reducer(dt, op)(out, srcs, 1.0)
        assert time.monotonic() - start < 1.0
    np.testing.assert_array_equal(out, np.maximum.reduce(srcs))
    assert wait_for_compiles(300)
    front = background(fold_kernel(kind, opcode, False, -1))
    assert any(getattr(types[1], "count", 0) == 5 for types in front.overloads)  # a UniTuple of 5 arrays
    again = np.empty_like(out)
    reducer(dt, op)(again, srcs, 1.0)
    np.testing.assert_array_equal(again, out)


def _python(code: str, cache: str, timeout: float = 300, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NUMBA_CACHE_DIR": cache, **env},
    )
    return done, time.monotonic() - start


def test_on_an_empty_cache_no_thread_of_the_caller_compiles(tmp_path):
    """Numba's compile events in this process: none (the compile helper, another process,
    compiled the kernels; this process only loaded them), the results right at once, and
    the fronts ready once the queue is waited for."""
    done, _ = _python(
        """
        import threading
        import numpy as np
        from numba.core import event
        from ferrodist.core import ReduceOp, int8, float16, reducer
        from ferrodist.core.kernels import PLAIN, PRODUCT, background, fold_kernel, wait_for_compiles

        threads = []
        class Seen(event.Listener):
            def on_start(self, ev):
                threads.append(threading.current_thread().name)
            def on_end(self, ev):
                pass
        event.register("numba:compile", Seen())
        a = np.arange(1, 200, dtype=np.int8)
        out = np.empty_like(a)
        reducer(int8, ReduceOp.PRODUCT)(out, [a, a], 1.0)
        assert (out == a * a).all()
        h = np.arange(200, dtype=np.float16)
        reducer(float16, ReduceOp.MAX)(h, [h, h[::-1].copy()], 1.0)
        assert (h == np.maximum(np.arange(200), np.arange(200)[::-1])).all()
        assert wait_for_compiles(300)
        assert not threads, threads
        assert background(fold_kernel(PLAIN, PRODUCT, False, -1)).overloads  # loaded, ready
        print("ok")
        """,
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "ok\n"


def test_a_process_exits_cleanly_while_the_background_thread_compiles(tmp_path):
    """An exit while the thread is inside LLVM crashed the process (SIGSEGV, or SIGABRT from
    an LLVM built with assertions) after the work was done. Now the exit drops the queue and
    holds llvmlite's lock: a handler registered before ferrodist's runs after it and sees the
    thread out of LLVM, and staying out; the exit does not wait for the whole queue."""
    done, took = _python(
        """
        import atexit
        import threading
        import time
        import numpy as np
        from numba.core import event

        calls = {"inside": 0, "entered": 0}

        class LLVMCalls(event.Listener):  # the compile thread's calls into LLVM
            def on_start(self, ev):
                if threading.current_thread().name == "ferrodist-compile":
                    calls["inside"] += 1
                    calls["entered"] += 1

            def on_end(self, ev):
                if threading.current_thread().name == "ferrodist-compile":
                    calls["inside"] -= 1

        event.register("numba:llvm_lock", LLVMCalls())

        def after_ferrodist():
            inside, entered = calls["inside"], calls["entered"]
            time.sleep(1.0)
            print("inside LLVM at exit:", inside, "entered since:", calls["entered"] - entered)
        atexit.register(after_ferrodist)

        from ferrodist.core import ALL_DTYPES, reducer

        for dt in ALL_DTYPES:  # every dtype's kernels queued: tens of seconds of compiling
            for op in dt.ops:
                a = np.zeros(4, dt.numpy)
                reducer(dt, op)(a, [a, a], 1.0)
        give_up = time.monotonic() + 60
        while calls["entered"] < 3 and time.monotonic() < give_up:
            time.sleep(0.001)  # until the thread is busy in LLVM
        print("leaving")
        """,
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "leaving\ninside LLVM at exit: 0 entered since: 0\n", done.stdout
    assert "Traceback" not in done.stderr and "Fatal" not in done.stderr, done.stderr
    assert took < 30


def test_a_fork_waits_for_the_compile_in_progress_and_the_child_compiles(tmp_path):
    """The child gets a free compiler lock and a thread of its own for what is queued."""
    done, _ = _python(
        """
        import os, time
        import numpy as np
        from ferrodist.core import ReduceOp, int16, uint32, reducer
        from ferrodist.core.kernels import wait_for_compiles

        a = np.arange(10, dtype=np.int16)
        reducer(int16, ReduceOp.SUM)(a, [a, a], 1.0)  # queued
        time.sleep(0.3)
        pid = os.fork()
        if pid == 0:
            b = np.arange(10, dtype=np.uint32)
            reducer(uint32, ReduceOp.BXOR)(b, [b, b], 1.0)
            assert (b == 0).all()
            os._exit(0 if wait_for_compiles(300) else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert wait_for_compiles(300)
        print("ok")
        """,
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "ok\n"


def test_interpreted_mode_queues_no_kernel(tmp_path):
    done, _ = _python(
        """
        import numpy as np
        from ferrodist.core import ReduceOp, float32, reducer
        from ferrodist.core.kernels import PLAIN, SUM, background, fold_kernel, wait_for_compiles

        a = np.ones(8, np.float32)
        reducer(float32, ReduceOp.SUM)(a, [a, a], 1.0)
        assert (a == 2).all()
        assert wait_for_compiles(5)
        assert not background(fold_kernel(PLAIN, SUM, False, 0)).overloads
        print("ok")
        """,
        str(tmp_path),
        FERRODIST_KERNELS="interpreted",
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_code_a_caller_waits_for_is_compiled_before_the_rest_of_the_queue():
    """``prepare(..., always=True)`` (code without an interpreted path, which its caller
    blocks on: the shared-memory waits) goes ahead of every queued request that has one,
    and after those queued the same way before it."""
    from numba import types

    from ferrodist.core._compile.background import _COMPILER

    def fresh(k: int):  # type: ignore[no-untyped-def]
        return jit(cache=False)(eval(f"lambda x: x + {k}"))  # a dispatcher of its own

    busy = background(fresh(0))
    with compiler_busy():
        first = prepare([(busy, (types.int64,))])  # the thread takes it and blocks on the lock
        give_up = time.monotonic() + 10
        while _COMPILER._current is None and time.monotonic() < give_up:
            time.sleep(0.01)
        later = prepare([(background(fresh(1)), (types.int64,))])
        urgent = prepare([(background(fresh(2)), (types.int64,))], always=True)
        urgent_too = prepare([(background(fresh(3)), (types.int64,))], always=True)
        last = prepare([(background(fresh(4)), (types.int64,))])
        order = [ticket for _, ticket in _COMPILER._queue]
    assert order == [urgent, urgent_too, later, last]
    assert all(t.wait(60) for t in (first, later, urgent, urgent_too, last))
