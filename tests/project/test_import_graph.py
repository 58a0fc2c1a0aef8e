"""The package's import graph runs one way: no cycles, and `relays/` never reaches `bridge/`.

Every module of sigil_push is parsed (not imported) and each import at module level is an
arrow, those under `if TYPE_CHECKING:` included: a cycle hidden from the interpreter still
makes a reader climb back up. Imports inside a function body are the deliberate lazy loads
(a provider's client library only when configured) and are not counted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import sigil_push

PACKAGE = Path(sigil_push.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Statements outside any function or class body (if/try/with blocks descended)."""
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            for child in getattr(node, field, ()):
                if isinstance(child, ast.ExceptHandler):
                    stack.extend(child.body)
                elif isinstance(child, ast.stmt):
                    stack.append(child)


def import_graph() -> dict[str, set[str]]:
    """Module → the sigil_push modules it imports."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        arrows: set[str] = set()
        for node in _module_level(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                arrows.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    arrows.add(submodule if submodule in paths else base)
        graph[name] = {a for a in arrows if a in paths and a != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_finder_sees_a_cycle_and_a_type_checking_import() -> None:
    """The checks below can fail: a two-module cycle is found, and an import under
    TYPE_CHECKING is an arrow like any other."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x import y\n"
        "def f():\n    import z\n"
    )
    imported = {
        alias.name
        for node in _module_level(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported == {"TYPE_CHECKING", "y"}, "TYPE_CHECKING counted, function bodies not"


def test_sigil_push_has_no_import_cycle() -> None:
    """No module climbs back up to one that imports it, TYPE_CHECKING imports included."""
    graph = import_graph()
    assert len(graph) > 50, "every module parsed"
    assert cycles(graph) == []


def test_relays_never_import_the_bridge() -> None:
    """The relay side hands frames up through `relays.port` only: no arrow from `relays/`
    (or `nostr/`) into `bridge/`, which sits above them."""
    graph = import_graph()
    upward = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith(("sigil_push.relays", "sigil_push.nostr"))
        for target in targets
        if target.startswith("sigil_push.bridge")
    )
    assert upward == []
    assert "sigil_push.relays.port" in graph["sigil_push.relays.pool"]
