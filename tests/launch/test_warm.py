"""`ferrodist warm`: what it compiles is what jobs load, and its command line says what it did.

The first test warms an empty cache (about 20 s here) and then runs jobs over shm and tcp
that log every kernel they get: each must say "loaded". A kernel whose argument types the
warm list gets wrong would be compiled by the job instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")

DTYPES = "float32,bool"  # a plain element type and a viewed one (bool as bytes, as the 16-bit floats as bits)

JOB = """
import sys
import numpy as np
import ferrodist.collectives as dist
from ferrodist.core import ReduceOp, dtype
from ferrodist.core.kernels import wait_for_compiles

group = dist.init_process_group(sys.argv[1])
p = group.size
for name in {dtypes!r}.split(","):
    numpy_type = dtype(name).numpy
    for n in (7, 3000, 600_000):  # one slot, one chunk, several chunks
        x = np.ones(n, numpy_type)
        for op in sorted(dtype(name).ops, key=lambda o: o.value):
            dist.all_reduce(x, op)
        dist.broadcast(x, 0)
        dist.reduce(x, 0)
        whole = np.zeros(n * p, numpy_type)
        dist.all_gather_into_tensor(whole, x)
        dist.reduce_scatter_tensor(x, whole)
for _ in range(100):  # enough small messages for tcp to want its compiled frames
    dist.all_reduce(np.ones(16, np.float32))
dist.barrier()
assert wait_for_compiles(120)
dist.destroy_process_group()
"""


def _ferrodist(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.timeout(900)
def test_after_warm_a_job_loads_every_kernel_and_compiles_none(tmp_path):
    cache = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    warmed = _ferrodist("warm", "--dtypes", DTYPES, "--ranks", "3", env=cache)
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB.format(dtypes=DTYPES)))
    for backend in ("shm", "tcp"):
        env = {**cache, "FERRODIST_DEBUG": "compile"}
        env.pop("FERRODIST_KERNELS", None)
        done = _ferrodist("run", "-n", "3", str(script), backend, env=env, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        lines = [line for line in done.stdout.splitlines() if "ferrodist compile:" in line]
        assert lines, done.stdout  # the log is on: the job got kernels and said so
        compiled = [line for line in lines if "loaded" not in line or "compiled" in line]
        assert not compiled, "\n".join(compiled)


def test_check_counts_without_compiling_and_fails_until_all_are_cached(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = _ferrodist("warm", "--check", "--dtypes", "int16", "--ranks", "2", env=env)
    assert done.returncode == 1
    assert done.stdout.startswith("ferrodist warm: 0 of ") and "run `ferrodist warm`" in done.stdout
    assert not list(tmp_path.rglob("*.nbc"))  # no code compiled into the cache


def test_a_dtype_it_does_not_know_is_refused_with_the_list(tmp_path):
    done = _ferrodist("warm", "--dtypes", "float32,complex64")
    assert done.returncode == 2
    assert "complex64" in done.stderr and "float32" in done.stderr and "bfloat16" in done.stderr
