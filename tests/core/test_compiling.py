"""Compiles run in a helper process and once per host; ``warm`` fills the cache ahead of time.

Each test runs Python in a process of its own on an empty ``NUMBA_CACHE_DIR``, so that
what it sees compiling is what it asked for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# Every function here records Numba's compile events of its own process into a file.
_RECORDER = """
import os, threading
from numba.core import event
compiled = []
class _Seen(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass
event.register("numba:compile", _Seen())
"""


def _python(code: str, cache: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RECORDER + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NUMBA_CACHE_DIR": str(cache), **env},
    )


def test_processes_compiling_one_function_at_once_compile_it_once(tmp_path):
    """Four processes ask for the same kernel at the same moment on an empty cache: one
    compiles it, the others wait for the host's lock and load its code."""
    go = tmp_path / "go"
    code = f"""
        import time
        from numba import typeof, types
        import numpy as np
        from ferrodist.core.kernels import fold_kernel, PLAIN, BXOR
        from ferrodist.core._compile.helper import compile_here
        kernel = fold_kernel(PLAIN, BXOR, False, -1)
        array = typeof(np.zeros(1, np.uint32))
        while not os.path.exists({str(go)!r}):
            time.sleep(0.005)
        compile_here(kernel, (array, types.UniTuple(array, 5), types.float64))
        x = np.arange(6, dtype=np.uint32)
        out = np.empty_like(x)
        kernel(out, (x, x, x, x, x), 1.0)
        assert (out == x).all()
        print(len([name for name in compiled if name.startswith("fold_kernel")]))
        """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RECORDER + textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")},
        )
        for _ in range(4)
    ]
    go.write_text("")
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(int(out.strip()) for out, _ in outs) == [0, 0, 0, 1], outs


def test_a_kernel_the_helper_cannot_make_compiles_in_the_process(tmp_path):
    """A front of a function in a module the helper cannot import (here: one on this
    process's sys.path only) is compiled by the process itself, and becomes ready."""
    module = tmp_path / "mods" / "own_kernels.py"
    module.parent.mkdir()
    module.write_text(
        "from ferrodist.core.kernels import jit\n\n"
        "@jit\n"
        "def triple(x):\n"
        "    for i in range(x.shape[0]):\n"
        "        x[i] *= 3\n"
    )
    done = _python(
        f"""
        import sys
        sys.path.insert(0, {str(module.parent)!r})
        import numpy as np
        import own_kernels
        from ferrodist.core.kernels import NotCompiled, background, prepare
        front = background(own_kernels.triple)
        assert front.recipe is not None  # a module-level function: the helper is asked first
        x = np.arange(4, dtype=np.int64)
        try:
            front(x)
        except NotCompiled as missing:
            ticket = prepare([(missing.front, missing.types)])
        assert ticket.wait(300) and ticket.failed is None, ticket.failed
        front(x)
        assert x.tolist() == [0, 3, 6, 9]
        print(compiled)
        """,
        tmp_path / "cache",
        FERRODIST_DEBUG="compile",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['triple']"
    assert "triple(" in done.stderr and "compiled here" in done.stderr, done.stderr


def test_without_a_helper_the_process_compiles_itself(tmp_path):
    """When no helper can start (here: no Python at sys.executable), the background thread
    compiles as it did before there were helpers, and the call's results are right."""
    done = _python(
        """
        import sys
        import numpy as np
        sys.executable = "/nonexistent/python"
        from ferrodist.core import ReduceOp, int16, reducer
        from ferrodist.core.kernels import wait_for_compiles
        a = np.arange(50, dtype=np.int16)
        reducer(int16, ReduceOp.MAX)(a, [a, a[::-1].copy()], 1.0)
        assert (a == np.maximum(np.arange(50), np.arange(50)[::-1])).all()
        assert wait_for_compiles(300)
        print([name for name in compiled if name.startswith("fold_kernel")])
        """,
        tmp_path / "cache",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['fold_kernel_0_3_0_1']"  # MAX, dst the first source


def test_warm_fills_the_cache_and_a_later_process_only_loads(tmp_path):
    cache = tmp_path / "cache"
    warmed = _python(
        """
        from ferrodist.core import int32
        from ferrodist.core.kernels import cached, reduction_kernels, warm
        kernels = reduction_kernels([int32], sources=(2,))
        before = cached(kernels)
        first = warm(kernels, processes=2)
        again = warm(kernels, processes=2)
        print(before, first.total, first.cached, first.compiled, first.failed, cached(kernels), again.compiled)
        print(len(compiled))
        """,
        cache,
    )
    assert warmed.returncode == 0, warmed.stderr
    counts, local = warmed.stdout.strip().splitlines()
    # int32 takes 7 ops (AVG folds as SUM), each with dst apart, first and second: 21 kernels.
    assert counts == "(0, 21) 21 0 21 [] (21, 21) 0", warmed.stdout
    assert local == "0"  # all of it in the helpers
    later = _python(
        """
        import numpy as np
        from ferrodist.core import ReduceOp, int32, reducer
        from ferrodist.core.kernels import wait_for_compiles
        a = np.arange(9, dtype=np.int32)
        for op in (ReduceOp.SUM, ReduceOp.BXOR, ReduceOp.MIN):
            reducer(int32, op)(a, [a, a], 1.0)
        assert wait_for_compiles(120)
        print(len(compiled))
        """,
        cache,
        FERRODIST_DEBUG="compile",
    )
    assert later.returncode == 0, later.stderr
    assert later.stdout.strip() == "0"
    assert "loaded" in later.stderr and "compiled" not in later.stderr, later.stderr


def test_a_fork_child_gets_a_helper_of_its_own(tmp_path):
    """The child drops the parent's pipes (the parent's helper still answers the parent)
    and asks a helper of its own; both processes get their kernels."""
    done = _python(
        """
        import os
        import numpy as np
        from ferrodist.core import ReduceOp, int64, uint16, reducer
        from ferrodist.core.kernels import wait_for_compiles
        a = np.arange(10, dtype=np.int64)
        reducer(int64, ReduceOp.PRODUCT)(a, [a, a], 1.0)
        assert wait_for_compiles(300)  # the parent's helper is running now
        pid = os.fork()
        if pid == 0:
            b = np.arange(10, dtype=np.uint16)
            reducer(uint16, ReduceOp.BOR)(b, [b, b], 1.0)
            os._exit(0 if wait_for_compiles(300) and not compiled else 3)
        c = np.arange(10, dtype=np.int64)
        reducer(int64, ReduceOp.MIN)(c, [c, c], 1.0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert wait_for_compiles(300)
        print(compiled)
        """,
        tmp_path / "cache",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
