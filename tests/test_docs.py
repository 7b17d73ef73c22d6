"""Every ```python block of README.md and docs/*.md runs as written.

How a block runs is decided from the block and from an optional marker, an HTML comment on
the last non-blank line above its fence:

- ``<!-- doc-test: skip (REASON) -->``: not run here; the test reports it skipped with REASON
  (a block that needs a CUDA GPU, several nodes, a cluster);
- ``<!-- doc-test: ferrodist run -n N -->``: run under ``ferrodist run -n N``;
- ``<!-- doc-test: python -->``: run as one process;
- a note in parentheses after ``python`` or ``ferrodist run -n N`` is for the reader;
- no marker: a block that calls ``init_process_group`` (other than the ``"simulated"``
  backend) runs under ``ferrodist run -n N``, N taken from a ``ferrodist run -n N`` in the
  block's own text, else 2; any other block runs with ``python``.

Blocks run in a scratch directory, two at a time, each with a time limit, on Numba's CUDA
simulator unless ``NUMBA_ENABLE_CUDASIM`` says otherwise. Blocks known not to run yet are
listed in ``KNOWN_FAILURES``, each with the page and the reason: they are expected to fail
(xfail, strict), so a block that gets fixed makes this test fail until its entry is removed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Seconds one block may run (a cold Numba cache compiles for a while in every rank).
BLOCK_TIMEOUT = 240.0
#: Blocks run at once (each is one process, or the ranks of one job).
PARALLEL = 2

#: Blocks that do not run as written yet: (page, a line of the block, why). Fix the block,
#: then remove its entry here.
KNOWN_FAILURES: list[tuple[str, str, str]] = []

MARKER = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->")
RUN_N = re.compile(r"ferrodist run -n (\d+)")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # the line of the opening fence, counting from 1
    code: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def command(self, script: Path) -> list[str] | str:
        """The command that runs this block from ``script``, or the reason it is skipped."""
        marker = self.marker
        if marker is not None:
            if marker.startswith("skip"):
                return marker[len("skip") :].strip(" ()") or "marked skip"
            how = re.sub(r"\s*\(.*\)$", "", marker)  # a note in parentheses is for the reader
            if how == "python":
                return [sys.executable, str(script)]
            ranks = RUN_N.fullmatch(how)
            if ranks is None:
                raise ValueError(f"{self.id}: unknown doc-test marker {marker!r}")
            return _ferrodist_run(int(ranks.group(1)), script)
        if re.search(r"init_process_group\((?!\s*[\"']simulated[\"'])", self.code):
            ranks = RUN_N.search(self.code)
            return _ferrodist_run(int(ranks.group(1)) if ranks else 2, script)
        return [sys.executable, str(script)]


def _ferrodist_run(n: int, script: Path) -> list[str]:
    return [sys.executable, "-m", "ferrodist.launch", "run", "-n", str(n), str(script)]


def blocks(page: Path) -> list[Block]:
    """The page's ```python blocks, each with the marker just above it (if any)."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        start = i
        above = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.fullmatch(above)
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: a ```python block without its closing fence")
        rel = page.relative_to(ROOT).as_posix()
        found.append(Block(rel, start + 1, "\n".join(body) + "\n", marker.group(1) if marker else None))
        i += 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def known_failure(block: Block) -> str | None:
    for page, line, why in KNOWN_FAILURES:
        if block.page == page and line in block.code:
            return why
    return None


def _run(block: Block, workdir: Path) -> subprocess.CompletedProcess[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "block.py"
    script.write_text(block.code)
    command = block.command(script)
    assert not isinstance(command, str)
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    env.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # blocks on device arrays run on the simulator
    try:
        return subprocess.run(
            command, cwd=workdir, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(command, -9, out, f"ran past {BLOCK_TIMEOUT} s")


class _Runner:
    """Runs the selected blocks PARALLEL at a time, starting all of them on first use."""

    def __init__(self, selected: list[Block], root: Path) -> None:
        self._selected = selected
        self._root = root
        self._futures: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(PARALLEL)

    def result(self, block: Block) -> subprocess.CompletedProcess[str]:
        with self._lock:
            if not self._futures:
                for b in self._selected:
                    workdir = self._root / re.sub(r"[^\w.-]", "_", b.id)
                    self._futures[b.id] = self._pool.submit(_run, b, workdir)
            if block.id not in self._futures:
                self._futures[block.id] = self._pool.submit(_run, block, self._root / "extra")
        return self._futures[block.id].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    chosen = {block.id for block in map(_block_of, request.session.items) if block is not None}
    selected = [b for b in ALL if b.id in chosen and not isinstance(b.command(Path("x")), str)]
    run = _Runner(selected, tmp_path_factory.mktemp("doc-blocks"))
    yield run
    run.close()


def _block_of(item: pytest.Item) -> Block | None:
    """The block a collected test runs, or None for other tests."""
    callspec = getattr(item, "callspec", None)
    block = callspec.params.get("block") if callspec is not None else None
    return block if isinstance(block, Block) else None


def _param(block: Block):  # type: ignore[no-untyped-def]
    why = known_failure(block)
    marks = [pytest.mark.xfail(reason=why, strict=True)] if why else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in ALL])
def test_doc_block_runs(block: Block, runner: _Runner) -> None:
    command = block.command(Path("block.py"))
    if isinstance(command, str):
        pytest.skip(f"{block.id}: {command}")
    done = runner.result(block)
    how = "ferrodist " + " ".join(command[3:-1]) if command[1] == "-m" else "python"
    assert done.returncode == 0, (
        f"{block.id} failed under `{how}` (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )


def test_the_pages_have_blocks_and_markers_are_known() -> None:
    assert len(ALL) >= 10, [b.id for b in ALL]
    for b in ALL:
        b.command(Path("block.py"))  # raises on a marker it does not know
