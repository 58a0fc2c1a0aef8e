"""The package's import graph runs one way: no cycles, and a declared order of layers.

Every module of sigil_push is parsed (not imported) and every import is an arrow: at module
level, under `if TYPE_CHECKING:`, and inside function bodies (the lazy loads, such as a
provider's sender only when its table is configured). A cycle hidden from the interpreter
still makes a reader climb back up. `LAYERS` lists the packages and top-level modules from the
bottom up; a module imports only from its own layer entry or one below it.
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


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it is: module level, TYPE_CHECKING blocks, function
    and class bodies."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def import_graph() -> dict[str, set[str]]:
    """Module → the sigil_push modules it imports."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        arrows: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
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


def test_the_finder_sees_a_cycle_and_every_kind_of_import() -> None:
    """The checks below can fail: a two-module cycle is found, and an import under
    TYPE_CHECKING or inside a function body is an arrow like any other."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x import y\n"
        "def f():\n    import z\nclass C:\n    def g(self):\n        from w import v\n"
    )
    imported = {alias.name for node in _imports(tree) for alias in node.names}
    assert imported == {"TYPE_CHECKING", "y", "z", "v"}


def test_sigil_push_has_no_import_cycle() -> None:
    """No module climbs back up to one that imports it, lazy and TYPE_CHECKING imports
    included."""
    graph = import_graph()
    assert len(graph) > 50, "every module parsed"
    assert cycles(graph) == []


def test_relays_never_import_the_bridge() -> None:
    """The relay side hands frames up through `relays.port` only: no arrow from `relays/`
    (or `nostr/`) into `bridge/`, which sits above them."""
    graph = import_graph()
    arrows = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith(("sigil_push.relays", "sigil_push.nostr"))
        for target in targets
        if target.startswith("sigil_push.bridge")
    )
    assert arrows == []
    assert "sigil_push.relays.port" in graph["sigil_push.relays.pool"]


LAYERS: tuple[tuple[str, ...], ...] = (
    ("sigil_push", "telemetry"),
    ("token_bucket", "errors", "shards", "supervisor"),
    ("nostr",),
    ("outbound", "sealed"),
    ("hosts",),
    ("config",),
    ("identity",),
    ("store",),
    ("iris",),
    ("push",),
    ("observations",),
    ("relays",),
    ("canary",),
    ("bridge", "delivery"),
    ("service",),
    ("http",),
    ("cli",),
    ("__main__",),
)
"""Bottom to top: each entry is a package of sigil_push or a top-level module (`sigil_push`
itself is the package's `__init__`, which holds only the version). Entries on one line are
peers that do not import each other."""


def _layer_entry(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _height() -> dict[str, int]:
    return {entry: height for height, peers in enumerate(LAYERS) for entry in peers}


def test_every_package_and_top_level_module_has_a_layer() -> None:
    """A new package or top-level module is placed in `LAYERS` (and nothing listed is gone)."""
    entries = {_layer_entry(module) for module in import_graph()}
    assert entries == set(_height())


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The arrows of `graph` that reach a layer entry at or above the importer's own (within
    one package or module, arrows are free)."""
    height = _height()
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if _layer_entry(module) != _layer_entry(target)
        and height[_layer_entry(target)] >= height[_layer_entry(module)]
    )


def test_the_layer_check_can_fail() -> None:
    """An arrow from the store up to the bridge, or between peers, is reported; one down is not."""
    assert upward({"sigil_push.store.seen": {"sigil_push.bridge.ingest"}}) == [
        "sigil_push.store.seen -> sigil_push.bridge.ingest"
    ]
    assert upward({"sigil_push.bridge.facade": {"sigil_push.delivery.plan"}}) != []
    assert upward({"sigil_push.bridge.facade": {"sigil_push.store.seen"}}) == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    """Arrows run down: a package never imports one above it, and peers on one line never
    import each other."""
    assert upward(import_graph()) == []
