"""The shape of the code: no module over 600 lines, no folder of more than 20 modules, and no
import circle, between modules or between the subpackages of a package (read from the source
with ``ast``, relative imports of any depth and imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p for p in REPO.glob("packages/*/src/ferrodist/*") if p.is_dir() and (p / "__init__.py").exists())
MAX_LINES = 600
MAX_MODULES = 20


def _modules(package: Path) -> dict[str, Path]:
    """Dotted name (inside the package) -> file, ``__init__`` as the folder's own name."""
    found = {}
    for path in package.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, package: str, known: set[str]) -> set[str]:
    """The modules of the same package that module ``name`` imports."""
    here = name.split(".") if name else []
    if path.name != "__init__.py":
        here = here[:-1]
    out: set[str] = set()

    def add(dotted: str) -> None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        if dotted:
            out.add(dotted)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and (node.module == package or node.module.startswith(package + ".")):
                stem = node.module[len(package) + 1 :]
            else:
                continue
            for alias in node.names:
                add(f"{stem}.{alias.name}".strip(".") if f"{stem}.{alias.name}".strip(".") in known else stem)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(package + "."):
                    add(alias.name[len(package) + 1 :])
    out.discard(name)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_module_is_over_600_lines_and_no_folder_holds_more_than_20(package: Path) -> None:
    for path in package.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines: split it by concern"
    for folder in [package, *(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        count = len(list(folder.glob("*.py")))
        assert count <= MAX_MODULES, f"{folder.relative_to(REPO)} holds {count} modules: group them by concept"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_import_circle_between_modules_or_subpackages(package: Path) -> None:
    dotted = "ferrodist." + package.name
    modules = _modules(package)
    known = set(modules)
    graph = {name: _imports(name, path, dotted, known) for name, path in modules.items() if name}
    # the package's own __init__ re-exports: it is not a module the others may import
    graph = {name: {m for m in deps if m} for name, deps in graph.items()}
    assert not _circles(graph), f"{dotted}: modules that import each other: {_circles(graph)}"
    # each subpackage as one: no two of them (or a subpackage and a module) import each other
    top = {name: {d.split(".")[0] for d in deps} - {name.split(".")[0]} for name, deps in graph.items()}
    folded: dict[str, set[str]] = {}
    for name, deps in top.items():
        folded.setdefault(name.split(".")[0], set()).update(deps)
    assert not _circles(folded), f"{dotted}: subpackages in a circle: {_circles(folded)}"


def test_the_circle_check_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
