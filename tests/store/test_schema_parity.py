"""One schema, two migration trees: after every migration of `migrations/` (SQLite) and of
`migrations/postgres/`, both engines hold the same tables with the same columns, each of the
same kind and nullability, except for the differences listed (and explained) here.

A new migration (0008 sealed, 0009 prefs, 0010 catchup, ...) adds its tables or columns to
both trees; this test then keeps passing without an edit. It fails when one tree forgot a
column, typed it differently, or when an intended difference listed below is gone (delete the
entry then). An engine-only table or column is added to ONLY_ON with the reason.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg

from sigil_push.store.postgres.migrate import migrate as migrate_postgres
from sigil_push.store.sqlite.database import migrate as migrate_sqlite

Column = tuple[str, bool]
"""(kind, nullable): kind is one of `integer`, `text`, `bytes`, `timestamp`."""

ONLY_ON: dict[str, dict[str, str]] = {
    "postgres": {
        "workers": "several workers' heartbeats (store.postgres.leases): one SQLite process"
        " has no peers",
        "shard_leases": "key shards leased to workers (store.postgres.leases)",
    },
    "sqlite": {},
}
"""Tables one engine has and the other has not, with why."""

COLUMN_DIFFERENCES: dict[tuple[str, str], tuple[Column | None, Column | None, str]] = {
    ("outbox", "claimed_by"): (
        None, ("text", True),
        ("the worker holding a claim: claims lapse between PostgreSQL workers, one SQLite"
         " process only marks rows it is sending (claimed_ms)"),
    ),
    ("outbox", "claimed_until_ms"): (
        None, ("integer", True), "when a dead worker's claim lapses (as claimed_by)",
    ),
    ("seen_events", "id"): (
        ("integer", False), None,
        ("SQLite's rowid made explicit: its rows (and the expiry index's entries) in arrival"
         " order, so a commit appends pages instead of rewriting random ones (0014); a"
         " PostgreSQL heap is in arrival order already"),
    ),
    ("catchup_items", "id"): (
        ("integer", False), None,
        "as seen_events' id: SQLite's rows in arrival order, the expiry index (created_at, id)",
    ),
    ("schema_migrations", "applied_at"): (
        ("integer", False), ("timestamp", False),
        "bookkeeping of each tree's own runner (Unix seconds / timestamptz); no code reads it",
    ),
}
"""Columns that differ on purpose: (SQLite, PostgreSQL) as (kind, nullable), None for absent."""

_SQLITE_KINDS = {"INTEGER": "integer", "TEXT": "text", "BLOB": "bytes"}
_POSTGRES_KINDS = {
    "bigint": "integer",
    "integer": "integer",
    "smallint": "integer",
    # SQLite has no boolean type: its flags (outbox.has_event) are 0/1 INTEGERs
    "boolean": "integer",
    "text": "text",
    "bytea": "bytes",
    "timestamp with time zone": "timestamp",
}


def sqlite_schema(path: Path) -> dict[str, dict[str, Column]]:
    """Every table's columns as (kind, nullable); a primary key counts as not nullable (SQLite
    keeps NULL out of an INTEGER PRIMARY KEY, and the code never writes NULL into the others)."""
    with sqlite3.connect(path) as db:
        tables = [row[0] for row in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        )]
        return {
            table: {
                name: (_SQLITE_KINDS[kind.upper()], not (notnull or primary_key))
                for _, name, kind, notnull, _, primary_key in db.execute(
                    f"PRAGMA table_info({table})"
                )
            }
            for table in tables
        }


async def postgres_schema(url: str) -> dict[str, dict[str, Column]]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(
            "SELECT table_name, column_name, data_type, is_nullable = 'YES'"
            " FROM information_schema.columns WHERE table_schema = 'public'"
        )
    finally:
        await connection.close()
    schema: dict[str, dict[str, Column]] = {}
    for table, column, kind, nullable in rows:
        schema.setdefault(table, {})[column] = (_POSTGRES_KINDS[kind], nullable)
    return schema


async def test_both_migration_trees_build_the_same_tables_and_columns(
    postgres_url: str, tmp_path: Path
) -> None:
    await migrate_sqlite(tmp_path / "store.db")
    await migrate_postgres(postgres_url)
    schemas = {
        "sqlite": sqlite_schema(tmp_path / "store.db"),
        "postgres": await postgres_schema(postgres_url),
    }
    for engine, other in (("sqlite", "postgres"), ("postgres", "sqlite")):
        alone = set(schemas[engine]) - set(schemas[other])
        assert alone == set(ONLY_ON[engine]), f"tables only on {engine}: {sorted(alone)}"
    shared = set(schemas["sqlite"]) & set(schemas["postgres"])
    assert {"devices", "outbox", "seen_events", "meta", "schema_migrations"} <= shared
    differences = {
        (table, column): (
            schemas["sqlite"][table].get(column), schemas["postgres"][table].get(column)
        )
        for table in shared
        for column in set(schemas["sqlite"][table]) | set(schemas["postgres"][table])
        if schemas["sqlite"][table].get(column) != schemas["postgres"][table].get(column)
    }
    intended = {where: (lite, pg) for where, (lite, pg, _why) in COLUMN_DIFFERENCES.items()}
    assert differences == intended
