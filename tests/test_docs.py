"""Every ```python block of README.md and docs/*.md runs as written.

How a block runs is decided from the block and from an optional marker, an HTML comment on
the last non-blank line above its fence:

- ``<!-- doc-test: skip (REASON) -->``: not run here; the test reports it skipped with REASON
  (a block that needs a CUDA GPU, several nodes, a cluster);
- ``<!-- doc-test: ferrodist run -n N -->``: run under ``ferrodist run -n N`` (or ``-n MIN:MAX``);
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
RUN_N = re.compile(r"ferrodist run -n (\d+(?::\d+)?)")


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
            return _ferrodist_run(ranks.group(1), script)
        if re.search(r"init_process_group\((?!\s*[\"']simulated[\"'])", self.code):
            ranks = RUN_N.search(self.code)
            return _ferrodist_run(ranks.group(1) if ranks else "2", script)
        return [sys.executable, str(script)]


def _ferrodist_run(n: str, script: Path) -> list[str]:
    return [sys.executable, "-m", "ferrodist.launch", "run", "-n", n, str(script)]


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


# -- figures and claims ------------------------------------------------------------------------
# The figures of the pages come from records (docs/figures, tools/figures.py), and what the
# pages say the code does is checked against the code: a page that drifts from either fails.

sys.path.insert(0, str(ROOT / "tools"))
import figures  # noqa: E402

DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("packages/*/README.md"))]
#: A cell that holds a measured figure: a time, a rate, a speed ratio.
MEASURED = re.compile(r"\d(?:\.\d+)? ?(?:us|ms|µs|GB/s|MB/s)\b|\d\.\d+x\b")
FENCE = re.compile(r"^\s*```")


def test_every_figure_block_is_what_its_records_render() -> None:
    stale = figures.differences()
    assert not stale, f"{stale}: run `python tools/figures.py write` (or record the figures again)"
    blocks = [m.group(2) for page in figures.PAGES for m in figures.BLOCK.finditer(page.read_text())]
    assert "headline" in blocks and len(blocks) >= 10, blocks


def _measured_rows_outside_blocks(page: Path) -> list[str]:
    """Table rows with measured figures that are neither in a figure block, nor in a code
    block, nor under a heading that says History: page:line of each."""
    found, headings, in_block, in_code = [], [], False, False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("<!-- figure:"):
            in_block = True
        elif line.startswith("<!-- /figure -->"):
            in_block = False
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            headings = [h for h in headings if h[0] < level] + [(level, line)]
        elif line.startswith("|") and MEASURED.search(line) and not in_block:
            if not any("History" in text for _, text in headings):
                found.append(f"{page.relative_to(ROOT)}:{number}: {line[:80]}")
    return found


def test_tables_of_measured_figures_are_generated_or_history() -> None:
    found = [row for page in DOC_PAGES for row in _measured_rows_outside_blocks(page)]
    assert not found, "tables of figures that no record generates:\n" + "\n".join(found)


def test_the_readme_fits_a_screens_patience() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_links_between_pages_reach_a_file_and_a_heading() -> None:
    broken = []
    for page in DOC_PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _launcher_env(**variables: str) -> dict[str, str]:
    return {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", **variables}


#: What init_process_group("auto") picks for a job on one host, a job over two hosts (as
#: `ferrodist run --nnodes 2` starts it), and a job under mpiexec.
AUTO_JOBS = {
    "one host": _launcher_env(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4"),
    "two nodes": _launcher_env(
        RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", NODE_RANK="1", GROUP_RANK="1"
    ),
    "mpiexec": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
}
#: (page, what the sentence says of which job, the pattern whose group names the backend).
AUTO_CLAIMS = [
    (
        "docs/launch.md",
        "two nodes",
        r"`LOCAL_WORLD_SIZE` is smaller than `WORLD_SIZE`, so\s+`init_process_group\(\)`\s+picks\s+`(\w+)`",
    ),
    ("README.md", "one host", r"`init_process_group\(\)` picks (shared memory) when every rank\s+is on this host"),
    (
        "README.md",
        "two nodes",
        r"the (two levels) \(shared memory inside each node, TCP between nodes\) when the\s+launcher says the ranks span hosts",
    ),
    ("README.md", "mpiexec", r"and (MPI) under `mpiexec`"),
]
#: The words pages use for each backend.
BACKEND_WORDS = {
    "shm": {"shm", "shared memory"},
    "levels": {"levels", "two levels"},
    "tcp": {"tcp", "TCP"},
    "mpi": {"mpi", "MPI"},
}


@pytest.mark.parametrize(("page", "job", "pattern"), AUTO_CLAIMS, ids=[f"{p}:{j}" for p, j, _ in AUTO_CLAIMS])
def test_what_the_pages_say_auto_picks_is_what_it_picks(page: str, job: str, pattern: str) -> None:
    pytest.importorskip("mpi4py")  # mpiexec's pick needs it installed
    from ferrodist.collectives import auto_backend

    said = re.search(pattern, (ROOT / page).read_text())
    assert said is not None, f"{page} no longer says what a job on {job} picks: update AUTO_CLAIMS with the page"
    picked, why, _ = auto_backend(AUTO_JOBS[job])
    assert said.group(1) in BACKEND_WORDS[picked], (
        f"{page} says {said.group(1)!r} for {job}; the code picks {picked} ({why})"
    )


def test_the_torch_pages_install_the_torch_the_backend_asks_for() -> None:
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "packages/torch/pyproject.toml").read_text())
    assert pin is not None
    for page in ("README.md", "docs/torch.md"):
        text = (ROOT / page).read_text()
        assert f"pip install torch=={pin.group(1)} --index-url https://download.pytorch.org/whl/cpu" in text, page


def test_no_page_says_the_gpu_code_never_ran_on_a_gpu() -> None:
    ran = figures.load("gpu")["machine"]  # a record of a run on a GPU
    for page in DOC_PAGES:
        text = re.sub(r"\s+", " ", page.read_text())
        assert "has not run on a GPU" not in text and "never ran on a GPU" not in text, (page, ran)


def test_pip_lines_name_the_paths_of_a_clone_and_one_matplotlib_hint() -> None:
    """The packages are on no index: `pip install ferrodist-gpu` cannot work. matplotlib is
    installed one way everywhere (the pages and the commands' own messages)."""
    by_name, hints = [], set()
    sources = [*DOC_PAGES, *sorted(ROOT.glob("packages/*/src/ferrodist/*/*.py"))]
    for path in sources:
        text = path.read_text()
        by_name += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"pip install [^\n`]*?'?ferrodist-\w+", text)]
        hints |= set(re.findall(r"pip install [^\s`'\"]*matplotlib[^\s`'\")]*|pip install '[^']*\[bench\]'", text))
    assert not by_name, by_name
    assert hints == {"pip install matplotlib"}, hints


DEMO_CHECKS = [
    ("examples/train_pipeline.py", r"worst\[0\] <= ([\de.-]+)", "docs/pipeline.md"),
    ("examples/train_ddp.py", r"diff <= ([\de.-]+)", "docs/ddp.md"),
]


@pytest.mark.parametrize(("example", "threshold", "page"), DEMO_CHECKS)
def test_pages_quote_the_demos_checks_not_one_runs_differences(example: str, threshold: str, page: str) -> None:
    """A demo's difference from one process moves with the CPU's arithmetic; what it
    promises is its check. A page quotes that bound, never a run's figure ("max difference
    1.6e-14" where the demo printed 3.6e-14)."""
    source = (ROOT / example).read_text()
    bound = re.search(threshold, source)
    assert bound is not None, f"{example}: its check is no longer where this test looks"
    value = next(g for g in bound.groups() if g)
    text = re.sub(r"\s+", " ", (ROOT / page).read_text())
    assert f"within {value}" in text, f"{page} should quote {example}'s check (within {value})"
    quoted = re.findall(r"(?:max difference|differ by) (\d(?:\.\d+)?e-\d+)", text)
    assert all(float(q) == float(value) for q in quoted), (page, quoted, value)
