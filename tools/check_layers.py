"""Check ferrodist's import rules (run from the repo root: ``python tools/check_layers.py [ROOT]``).

Four rules, read from the source with ``ast`` (nothing is imported):

1. Layers: a package imports only the ferrodist packages that ``ALLOWED`` lists for it
   (absolute ``import ferrodist.x`` / ``from ferrodist.x import ...``; relative imports
   stay inside their package). A package or import target missing from ``ALLOWED`` is an error.
2. Namespace: no ``packages/*/src/ferrodist/__init__.py`` (``ferrodist`` is a PEP 420 namespace).
3. No side effects at import: the optional heavy dependencies in ``HEAVY`` are imported
   inside the functions that need them, never when a module under ``packages/`` is imported
   (except by a package that exists for one of them: ``REQUIRES``).
4. Public only: a package imports no private module (``ferrodist.x._y``) of another one;
   what a sibling needs, ``ferrodist.x`` or a public module of it exports.
5. No private attributes of a sibling: a package reads or writes no attribute ``obj._name``
   that only another ferrodist package defines (a method, a class, an attribute assigned,
   a module-level name or a parameter of that package, and nowhere in this one). A name
   that both define counts as this package's own; Python's ``__dunder__`` names and
   third-party names are not checked.

Prints ``path:line: message`` per violation and exits 1, or prints one OK line and exits 0.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

#: package -> the ferrodist packages it may import (besides itself), as ARCHITECTURE.md's
#: dependency rule draws them (core is everyone's base). Extend when adding one.
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "transport": frozenset({"core"}),
    "collectives": frozenset({"transport", "core"}),
    "testing": frozenset({"collectives", "core"}),
    "nn": frozenset(),
    # gpu's staged engine implements core's device-engine protocol.
    "gpu": frozenset({"collectives", "core"}),
    # The NCCL engine implements core's device-engine protocol; its bf16 compression
    # casts with the kernels registered under ``ferrodist.device_casts`` (gpu's).
    "nccl": frozenset({"core"}),
    "ddp": frozenset({"collectives", "core"}),
    "pipeline": frozenset({"collectives", "core"}),
    "elastic": frozenset({"collectives", "core"}),
    "launch": frozenset({"collectives", "core"}),
    "torch": frozenset({"collectives", "core"}),
    "ferrodist": frozenset(),  # the meta-distribution ships no code of its own
}

#: Optional heavy dependencies: a module name or any of its submodules.
HEAVY = ("torch", "mpi4py", "cuda", "numba.cuda", "numba_cuda", "cupy", "jax")
#: package -> the heavy dependencies it is built on (a hard dependency in its pyproject.toml,
#: nobody else's), which its modules may import at module level: ferrodist.torch subclasses
#: torch's classes, and a user imports it only where torch is.
REQUIRES: dict[str, tuple[str, ...]] = {"torch": ("torch",)}

_SKIP_DIRS = {"__pycache__", "build", "dist"}


def _python_files(top: Path) -> Iterator[Path]:
    for path in sorted(top.rglob("*.py")):
        rel = path.relative_to(top).parts[:-1]
        if not any(p in _SKIP_DIRS or p.startswith(".") or p.endswith(".egg-info") for p in rel):
            yield path


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """Absolute module names an import statement binds (``from a import b`` gives ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level or node.module is None:
        return []  # relative: stays inside its own package
    return [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"] or [node.module]


def _is_heavy(name: str) -> bool:
    return any(name == h or name.startswith(h + ".") for h in HEAVY)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: outside functions and ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _import_time(node.orelse)
        else:  # class bodies, if/try/with/for/while/match blocks all run at import time
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _import_time([child])
                elif isinstance(child, (ast.ExceptHandler, ast.match_case)):
                    yield from _import_time(child.body)


def _parse(path: Path, rel: str, errors: list[str]) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    except (SyntaxError, UnicodeDecodeError) as exc:
        errors.append(f"{rel}:{getattr(exc, 'lineno', None) or 1}: cannot parse: {exc}")
        return None


def _heavy_violations(tree: ast.Module, rel: str, pkg: str | None) -> Iterator[str]:
    required = REQUIRES.get(pkg or "", ())
    for node in _import_time(tree.body):
        for name in _imported(node):
            if _is_heavy(name) and not any(name == r or name.startswith(r + ".") for r in required):
                yield (
                    f"{rel}:{node.lineno}: module-level import of optional dependency {name!r}; "
                    "import it inside the function that needs it"
                )


def _layer_violations(tree: ast.Module, rel: str, pkg: str) -> Iterator[str]:
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for name in _imported(node):
            parts = name.split(".")
            if parts[0] != "ferrodist" or len(parts) < 2 or parts[1] == pkg:
                continue
            if parts[1] not in ALLOWED:
                yield f"{rel}:{node.lineno}: import of unknown ferrodist package 'ferrodist.{parts[1]}'"
            elif parts[1] not in ALLOWED[pkg]:
                allowed = ", ".join(sorted(ALLOWED[pkg])) or "no other ferrodist package"
                yield f"{rel}:{node.lineno}: ferrodist.{pkg} must not import ferrodist.{parts[1]} (it may import: {allowed})"
            elif len(parts) > 2 and parts[2].startswith("_"):
                yield (
                    f"{rel}:{node.lineno}: ferrodist.{pkg} imports the private module ferrodist.{parts[1]}.{parts[2]}; "
                    f"use what ferrodist.{parts[1]} makes public"
                )


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, their parameters, names and
    attributes it assigns, and what it imports under a name."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            args = node.args
            names.update(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs])
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
        elif isinstance(node, ast.keyword) and node.arg is not None:
            names.add(node.arg)  # setattr-free dataclass/namedtuple fields given by keyword
    return {name for name in names if _private(name)}


def _attribute_violations(
    trees: dict[str, list[tuple[str, ast.Module]]], defined: dict[str, set[str]]
) -> Iterator[str]:
    """Rule 5 over every package's modules (``trees``: package -> (path, module))."""
    for pkg, modules in trees.items():
        for rel, tree in modules:
            for node in ast.walk(tree):
                name = _attribute_used(node)
                if name is None or not _private(name) or name in defined[pkg]:
                    continue
                owners = sorted(other for other, names in defined.items() if other != pkg and name in names)
                if owners:
                    yield (
                        f"{rel}:{getattr(node, 'lineno', 1)}: ferrodist.{pkg} uses the private attribute {name!r} of "
                        f"{', '.join('ferrodist.' + owner for owner in owners)}; ask for a public name"
                    )


def _attribute_used(node: ast.AST) -> str | None:
    """The attribute ``node`` reads or writes: ``obj.name``, or ``getattr``/``setattr``/
    ``hasattr``/``delattr`` with the name as a string literal."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def check(root: Path) -> tuple[list[str], int]:
    """All violations under ``root`` (a checkout) and the number of files read."""
    errors: list[str] = []
    packages_dir = root / "packages"
    for init in sorted(packages_dir.glob("*/src/ferrodist/__init__.py")):
        errors.append(f"{init.relative_to(root)}:1: ferrodist is a PEP 420 namespace package; delete this file")

    owner: dict[Path, str] = {}  # file -> the ferrodist package it belongs to
    for pkg_dir in sorted(p for p in packages_dir.glob("*/src/ferrodist/*") if p.is_dir()):
        if pkg_dir.name in _SKIP_DIRS or pkg_dir.name.startswith(".") or pkg_dir.name.endswith(".egg-info"):
            continue
        if pkg_dir.name not in ALLOWED:
            errors.append(
                f"{pkg_dir.relative_to(root)}:1: unknown package {pkg_dir.name!r}; "
                "add it to ALLOWED in tools/check_layers.py"
            )
        owner.update(dict.fromkeys(_python_files(pkg_dir), pkg_dir.name))

    files = list(_python_files(packages_dir)) if packages_dir.is_dir() else []
    if not files:
        errors.append(f"{packages_dir}:1: no Python files found; is {root} a ferrodist checkout?")
    trees: dict[str, list[tuple[str, ast.Module]]] = {}
    defined: dict[str, set[str]] = {}
    for path in files:
        rel = str(path.relative_to(root))
        tree = _parse(path, rel, errors)
        if tree is None:
            continue
        pkg = owner.get(path)
        errors.extend(_heavy_violations(tree, rel, pkg))
        if pkg in ALLOWED:
            errors.extend(_layer_violations(tree, rel, pkg))
        if pkg is not None:
            trees.setdefault(pkg, []).append((rel, tree))
            defined.setdefault(pkg, set()).update(_defined(tree))
    errors.extend(_attribute_violations(trees, defined))
    return errors, len(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()
    errors, count = check(root)
    for line in errors:
        print(line)
    if errors:
        print(f"check_layers: {len(errors)} violation(s)", file=sys.stderr)
        return 1
    print(
        f"check_layers: OK ({count} files under {root / 'packages'}: layers, namespace, lazy heavy imports, public only, no sibling's private attributes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
