"""The packages install alone: core in a brand-new venv, then transport and collectives on top,
with no torch, mpi4py, cuda-python, numba-cuda or cupy anywhere in that venv.

Uses pip's configured index (no network fallback is faked): a failed install fails the test
with pip's output, because this is the proof that the layering holds for users.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = REPO / "packages"

CORE_SCRIPT = """\
import sys

import numpy as np

import ferrodist.core as fc

assert fc.__file__.startswith(sys.prefix), f"ferrodist.core came from {fc.__file__}, not the venv"
a = np.arange(6, dtype=np.float32)
b = np.full(6, 2.0, np.float32)
c = np.array([5, -1, 0, 7, 1, 3], np.float32)
out = np.empty(6, np.float32)
fc.reduce_many(out, [a, b, c], fc.ReduceOp.SUM)
np.testing.assert_array_equal(out, a + b + c)
fc.reduce_many(out, [a, b, c], "max")
np.testing.assert_array_equal(out, np.maximum(np.maximum(a, b), c))
print("core ok")
"""

COLLECTIVES_SCRIPT = """\
import importlib.util
import sys
import threading

import numpy as np

import ferrodist.collectives as dist
from ferrodist.transport import SimulatedTransport

for mod in (dist, sys.modules["ferrodist.transport"], sys.modules["ferrodist.core"]):
    assert mod.__file__.startswith(sys.prefix), f"{mod.__name__} came from {mod.__file__}, not the venv"

results = {}
errors = []


def rank_main(transport):
    try:
        dist.init_process_group("simulated", transport=transport)
        try:
            x = np.array([1.0, 2.0, 3.0]) * (transport.rank + 1)
            dist.all_reduce(x)
            results[transport.rank] = x
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported from the main thread
        errors.append(f"rank {transport.rank}: {exc!r}")


threads = [threading.Thread(target=rank_main, args=(t,)) for t in SimulatedTransport.create_group(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
assert not any(t.is_alive() for t in threads), "all_reduce did not finish in 120 s"
assert not errors, errors
for rank in (0, 1):
    np.testing.assert_array_equal(results[rank], [3.0, 6.0, 9.0])

heavy = ("torch", "mpi4py", "cuda", "numba_cuda", "cupy")
installed = [name for name in heavy if importlib.util.find_spec(name) is not None]
assert not installed, f"optional heavy dependencies are installed: {installed}"
imported = sorted(m for m in sys.modules if m.split(".")[0] in (*heavy, "jax") or m.startswith("numba.cuda"))
assert not imported, f"optional heavy dependencies were imported: {imported}"
print("collectives ok")
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _text(stream: str | bytes | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    """Run ``cmd``; fail the test with its full output if it fails or runs too long."""
    try:
        result = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        problem, out, err = f"timed out after {timeout} s", _text(exc.stdout), _text(exc.stderr)
    else:
        problem, out, err = f"exit status {result.returncode}", result.stdout, result.stderr
        if result.returncode == 0:
            return out
    pytest.fail(f"{problem}: {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}", pytrace=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_core_alone_then_collectives_install_without_heavy_dependencies(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, timeout=120)
    python = str(venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
    pip = [python, "-m", "pip", "install", "-q", "--no-input"]

    # Each step's timeout is below the test's 900 s budget in total (120 + 300 + 90 + 240 + 90).
    # (a) core alone.
    _run([*pip, str(PACKAGES / "core")], cwd=tmp_path, timeout=300)
    (tmp_path / "core_check.py").write_text(CORE_SCRIPT, encoding="utf-8")
    assert "core ok" in _run([python, "core_check.py"], cwd=tmp_path, timeout=90)

    # (b) transport and collectives on top (core 0.1.0 is already there for their pins).
    _run([*pip, str(PACKAGES / "transport"), str(PACKAGES / "collectives")], cwd=tmp_path, timeout=240)
    (tmp_path / "collectives_check.py").write_text(COLLECTIVES_SCRIPT, encoding="utf-8")
    assert "collectives ok" in _run([python, "collectives_check.py"], cwd=tmp_path, timeout=90)
