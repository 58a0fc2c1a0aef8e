"""The store's seams, read from the source: only `sigil_push/store/` speaks SQL, nothing
outside it picks an engine, and the store imports nothing above it (issue 23).

These are checks on the code's shape, so a change that breaks a seam fails here with the file
and line, instead of being found by the next reader.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sigil_push"
STORE = PACKAGE / "store"
SQL = re.compile(
    r"[\"'](SELECT|INSERT|UPDATE|DELETE FROM|BEGIN|COMMIT|PRAGMA|CREATE (TABLE|INDEX))\b",
    re.IGNORECASE,
)
BELOW_THE_STORE = ("sigil_push.store", "sigil_push.config", "sigil_push.identity",
                   "sigil_push.nostr", "sigil_push.shards", "sigil_push.supervisor",
                   "sigil_push.telemetry")
"""What the store may import: itself and the bottom layers (no delivery, bridge, relays, API)."""


def _modules(outside_store: bool) -> list[Path]:
    return [
        path for path in sorted(PACKAGE.rglob("*.py"))
        if (STORE not in path.parents) == outside_store
    ]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, TYPE_CHECKING blocks and function bodies
    included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def test_no_sql_text_outside_the_store() -> None:
    offending = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in _modules(outside_store=True)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if SQL.search(line)
    ]
    assert offending == []


def test_nothing_outside_the_store_picks_an_engine() -> None:
    """Service, CLI, API, bridge: they get a `Store` (its repositories and `coordination`)
    and never import an engine's modules nor ask whether the URL is PostgreSQL."""
    offending = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
        for path in _modules(outside_store=True)
        for line, module in _imports(path)
        if module.startswith(("sigil_push.store.sqlite", "sigil_push.store.postgres"))
        or module.endswith((".is_postgres_url", ".PostgresStore", ".SqliteStore"))
    ]
    assert offending == []


def test_the_store_imports_nothing_above_it() -> None:
    offending = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
        for path in _modules(outside_store=False)
        for line, module in _imports(path)
        if module.startswith("sigil_push") and not module.startswith(BELOW_THE_STORE)
    ]
    assert offending == []
