"""A TCP link owns everything of its peer (socket, framing, matching, pending receives), as
Gloo's ``pair`` does: what it needs of its transport is handed to it (the links' shared
``Context``, constructor arguments), never read from the transport's private fields.

Read from the source with ``ast`` (nothing is imported): the rule is that in the modules
below the transport (the link, its framing, its mailbox, the records, the context, the
compiled frames)
every private attribute (``x._name``, not a ``__dunder__``) is one of ``self``'s, and none
of them imports the transport module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ferrodist.transport

TCP = Path(ferrodist.transport.__file__).parent / "_tcp"
BELOW_THE_TRANSPORT = ("link", "framing", "mailbox", "records", "context", "compiled")


def _private_reaches(tree: ast.AST) -> list[str]:
    """``line: expression`` of every private attribute of something other than ``self``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            continue
        found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {text}" for line, text in sorted(found)]


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names.add("." * node.level + module)
            names.update(f"{'.' * node.level}{module}.{alias.name}".replace("..", ".") for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("module", BELOW_THE_TRANSPORT)
def test_below_the_transport_no_module_reads_another_objects_private_attributes(module: str) -> None:
    path = TCP / f"{module}.py"
    reaches = _private_reaches(ast.parse(path.read_text(), str(path)))
    assert reaches == [], f"{path.name} reaches into other objects' private attributes:\n" + "\n".join(reaches)


@pytest.mark.parametrize("module", BELOW_THE_TRANSPORT)
def test_below_the_transport_no_module_imports_it(module: str) -> None:
    path = TCP / f"{module}.py"
    imported = _imports(ast.parse(path.read_text(), str(path)))
    assert not any(
        name in (".transport", "ferrodist.transport._tcp.transport") or name.endswith(".TcpTransport")
        for name in imported
    ), f"{path.name} imports the transport: {sorted(imported)}"


def test_the_rule_catches_a_reach_into_the_transport() -> None:
    tree = ast.parse("def f(self, t):\n    self._ok = t._lost\n    return self.transport._cond, t.__class__\n")
    assert _private_reaches(tree) == ["2: t._lost", "3: self.transport._cond"]
