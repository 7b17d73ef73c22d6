"""Numba's on-disk cache under processes that compile at the same time.

Numba saves a cache entry by reading the function's index, picking the first free data
file number, then writing the index and the data with nothing held in between; ranks that
start together on an empty cache race on it, and an index can end up naming another
signature's code (seen in ``make test``: ``TypeError: can't unbox array`` in one rank). The
kernels' cache (``ferrodist.core._compile.jit.SafeCache``) locks each save and load and refuses an
entry compiled for other argument types.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ferrodist.core._compile import jit as _jit

STAMP = (1.0, 1)


def _save_many(path: str, writer: int, count: int) -> None:
    cache = _jit.LockedCacheFile(cache_path=path, filename_base="f-1.py3", source_stamp=STAMP)
    for i in range(count):
        cache.save((writer, i), ("code of", writer, i))


def test_processes_saving_at_once_keep_every_entry_with_its_own_data(tmp_path):
    writers, count = 4, 30
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_save_many, args=(str(tmp_path), w, count)) for w in range(writers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    cache = _jit.LockedCacheFile(cache_path=str(tmp_path), filename_base="f-1.py3", source_stamp=STAMP)
    index = cache._load_index()
    assert sorted(index) == [(w, i) for w in range(writers) for i in range(count)]  # nothing lost
    for key in index:
        assert cache.load(key) == ("code of", *key)  # and each names its own data


def test_the_kernels_use_the_safe_cache():
    from ferrodist.core.kernels import PLAIN, SUM, fold_kernel

    kernel = fold_kernel(PLAIN, SUM, False, -1)
    assert isinstance(kernel._cache, _jit.SafeCache)
    assert isinstance(kernel._cache._cache_file, _jit.LockedCacheFile)


MODULE = """
import numpy as np
import numba
from ferrodist.core._compile.jit import jit

def twice(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = x[i] * 2
    return out

safe = jit(twice)
plain = numba.njit(cache=True)(twice)
"""

CALL = """
import sys
import numpy as np
import doubling
f = getattr(doubling, sys.argv[1])
print(f(np.arange(3, dtype=np.int32)).tolist(), f(np.arange(3, dtype=np.float32)).tolist())
"""


def _run(tmp_path: Path, which: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", CALL, which], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )


def _swap_entries(tmp_path: Path, name: str) -> None:
    """Make the index name each signature's data file for the other one, as the race can."""
    (index_path,) = (tmp_path / "cache").rglob(f"*{name}*.nbi")
    cache = _jit.LockedCacheFile.__new__(_jit.LockedCacheFile)
    cache._index_path = str(index_path)
    cache._version = _jit.caching.IndexDataCacheFile(str(index_path.parent), "x", STAMP)._version
    with open(index_path, "rb") as f:
        import pickle

        pickle.load(f)
        stamp, overloads = pickle.loads(f.read())
    cache._source_stamp = stamp
    keys = list(overloads)
    assert len(keys) == 2
    overloads[keys[0]], overloads[keys[1]] = overloads[keys[1]], overloads[keys[0]]
    cache._save_index(overloads)


@pytest.mark.parametrize("which", ["safe", "plain"])
def test_an_entry_for_other_argument_types_is_recompiled_not_run(tmp_path, which):
    (tmp_path / "doubling.py").write_text(textwrap.dedent(MODULE))
    first = _run(tmp_path, which)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["[0,", "2,", "4]", "[0.0,", "2.0,", "4.0]"]
    _swap_entries(tmp_path, "twice")
    again = _run(tmp_path, which)
    if which == "safe":
        assert again.returncode == 0, again.stderr
        assert again.stdout == first.stdout
    else:  # the control: Numba's own cache runs the other signature's code on these arrays
        assert again.returncode != 0 or again.stdout != first.stdout


CALLER = """
import itertools, json, sys
import numpy as np
from numba.core.bytecode import FunctionIdentity
from ferrodist.core.kernels import PLAIN, PRODUCT, fold_kernel, jit

other = None
if sys.argv[1] == "second":  # a new process: the other variant (dst is source 0) compiled
    # first, on the counter value the first process gave the callee; then the cached caller
    FunctionIdentity._unique_ids = itertools.count(int(sys.argv[2]))
    other = fold_kernel(PLAIN, PRODUCT, False, 0)
    other(np.ones(1, np.int8), (np.ones(1, np.int8), np.ones(1, np.int8)), 1.0)
apart = fold_kernel(PLAIN, PRODUCT, False, -1)  # the variant the caller calls: dst apart


@jit
def caller(out, a, b):
    apart(out, (a, b), 1.0)

a, b, out = np.array([2, 111, 10], np.int8), np.array([-44, -18, -117], np.int8), np.zeros(3, np.int8)
caller(out, a, b)
compiled = [k.fndesc.unique_name for f in (apart, other) if f for k in f.overloads.values()]
print(json.dumps({"out": out.tolist(), "compiled": compiled, "cached": bool(caller.stats.cache_hits)}))
"""


def test_a_cached_caller_keeps_its_own_kernel_variant(tmp_path):
    """Two variants of one kernel factory, the same numba counter value in two processes:
    the caller cached by the first must still call the variant it was compiled with (before
    each variant had a name of its own, it ran the other one: rank 0's shm all_reduce of
    int8 PRODUCT returned its own data squared, depending on the order things compiled)."""
    import json

    (tmp_path / "caller_module.py").write_text(CALLER)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path))
    runs = []
    for args in (["first"], ["second"]):
        if args == ["second"]:
            args.append(runs[0]["compiled"][0].rpartition("$")[2])
        done = subprocess.run(
            [sys.executable, str(tmp_path / "caller_module.py"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[1]["cached"], runs  # the second process loaded the caller from the cache
    # ... after compiling the other variant under the counter value of the caller's callee
    assert runs[1]["compiled"][0].rpartition("$")[2] == runs[0]["compiled"][0].rpartition("$")[2], runs
    expected = (np.array([2, 111, 10]) * np.array([-44, -18, -117])).astype(np.int8).tolist()
    assert runs[0]["out"] == runs[1]["out"] == expected, runs


def test_cached_kernels_are_keyed_on_the_kernels_source():
    """A cached caller carries copies of the kernels it calls; its entry names the kernels'
    source, so a change there compiles the callers afresh instead of keeping old code."""
    from ferrodist.core.kernels import PLAIN, SUM, fold_kernel

    kernel = fold_kernel(PLAIN, SUM, False, -1)
    kernel(np.ones(2), (np.ones(2), np.ones(2)), 1.0)
    key = kernel._cache._index_key(kernel.signatures[0], kernel.targetctx.codegen())
    assert key[-1] == _jit._kernels_stamp() and len(key[-1]) == 64
