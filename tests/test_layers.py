"""tools/check_layers.py: passes on this checkout, and catches each kind of violation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKER = REPO / "tools" / "check_layers.py"


def run_checker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECKER), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def write(root: Path, rel: str, source: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source), encoding="utf-8")


def test_real_tree_passes() -> None:
    result = run_checker()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_allowed_imports_pass(tmp_path: Path) -> None:
    write(tmp_path, "packages/core/src/ferrodist/core/__init__.py", "from ._a import a\n")
    write(
        tmp_path,
        "packages/core/src/ferrodist/core/_a.py",
        """\
        from typing import TYPE_CHECKING

        import ferrodist.core._b
        from . import _b

        if TYPE_CHECKING:
            import torch


        def a():
            import torch
            from numba import cuda

            return torch, cuda
        """,
    )
    write(tmp_path, "packages/core/src/ferrodist/core/_b.py", "")
    write(
        tmp_path,
        "packages/collectives/src/ferrodist/collectives/_x.py",
        "import ferrodist.transport\nfrom ferrodist.core import ReduceOp\nfrom ferrodist import core\n",
    )
    result = run_checker(str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_violations_are_reported(tmp_path: Path) -> None:
    core = "packages/core/src/ferrodist/core"
    write(tmp_path, f"{core}/x.py", "import numpy\nimport ferrodist.collectives\nimport torch\n")
    write(tmp_path, f"{core}/y.py", "try:\n    from numba import cuda\nexcept ImportError:\n    cuda = None\n")
    write(tmp_path, "packages/transport/src/ferrodist/transport/z.py", "from ferrodist.testing import run_world\n")
    write(tmp_path, "packages/transport/src/ferrodist/__init__.py", "")
    write(tmp_path, "packages/mystery/src/ferrodist/mystery/__init__.py", "")
    write(tmp_path, "packages/launch/src/ferrodist/launch/w.py", "from ferrodist.nope import thing\n")
    write(
        tmp_path,
        "packages/launch/src/ferrodist/launch/v.py",
        "from ferrodist.core import kernels\nfrom ferrodist.core._jit import jit\n",
    )
    result = run_checker(str(tmp_path))
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    expected = [
        f"{core}/x.py:2: ferrodist.core must not import ferrodist.collectives",
        f"{core}/x.py:3: module-level import of optional dependency 'torch'",
        f"{core}/y.py:2: module-level import of optional dependency 'numba.cuda'",
        "packages/transport/src/ferrodist/transport/z.py:1: ferrodist.transport must not import ferrodist.testing",
        "packages/transport/src/ferrodist/__init__.py:1: ferrodist is a PEP 420 namespace package",
        "packages/mystery/src/ferrodist/mystery:1: unknown package 'mystery'",
        "packages/launch/src/ferrodist/launch/w.py:1: import of unknown ferrodist package 'ferrodist.nope'",
        "packages/launch/src/ferrodist/launch/v.py:2: ferrodist.launch imports the private module ferrodist.core._jit",
    ]
    for line in expected:
        assert line in out, f"missing {line!r} in:\n{out}"
    assert len(out.splitlines()) == len(expected), out
    assert "OK" not in out


def test_a_siblings_private_attributes_are_refused(tmp_path: Path) -> None:
    write(
        tmp_path,
        "packages/core/src/ferrodist/core/_tensor.py",
        """\
        class Tensor:
            def __init__(self, array):
                self._array = array
                self._shared = 1

            def _flat(self):
                return self._array
        """,
    )
    write(
        tmp_path,
        "packages/nccl/src/ferrodist/nccl/_buffers.py",
        """\
        def pointer(t, m):
            a = t._array
            b = getattr(t, "_flat")()
            c = m._shared  # nccl defines _shared too: its own name
            d = t.__class__, t._numba_internal  # dunder names and third-party names pass
            return a, b, c, d


        class Box:
            _shared = 0
        """,
    )
    result = run_checker(str(tmp_path))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines == [
        "packages/nccl/src/ferrodist/nccl/_buffers.py:2: ferrodist.nccl uses the private attribute '_array' of "
        "ferrodist.core; ask for a public name",
        "packages/nccl/src/ferrodist/nccl/_buffers.py:3: ferrodist.nccl uses the private attribute '_flat' of "
        "ferrodist.core; ask for a public name",
    ], result.stdout


def test_empty_root_is_an_error(tmp_path: Path) -> None:
    result = run_checker(str(tmp_path))
    assert result.returncode == 1
    assert "no Python files found" in result.stdout
