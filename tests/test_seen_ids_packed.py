"""Handled event ids as their 32 bytes, in arrival order (migration 0014, issue 23's ingest).

A DM's `seen_events` row is written in every batch's transaction; the hex ids of the old
WITHOUT ROWID table spread those inserts (and the expiry index's, keyed by one second's
`keep_until` and then the id) over every page. 0014 keeps the same rows with the ids' bytes
under a unique index, in a rowid table on SQLite. The rows a database already holds are moved
whole: every id still de-duplicates, with every relay that delivered it (the legacy
`seen_on_relay` rows included), and is pruned when its time comes.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg
import pytest

from sigil_push.store.postgres.bridge_state import PostgresSeenRows
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.migrate import available, migrate_connection
from sigil_push.store.seen import SeenEvents
from sigil_push.store.sqlite.bridge_state import SqliteSeenRows
from sigil_push.store.sqlite.database import MigrationError, open_database
from tests.support.old_schema import sqlite_at

PACKED = 14
OLD_ROWS = [
    ("ab" * 32, "wss://a wss://b", 2_000),
    ("01" * 32, "wss://a", 1_000),
    ("ff" * 32, "wss://c", 3_000),
]
"""(hex id, relays, keep_until) as releases before 0014 wrote them, not in keep_until order."""
LEGACY = ("01" * 32, "wss://d", 1_000)
"""A further relay recorded in `seen_on_relay`, as releases before further relays were
appended in place wrote it."""


async def _assert_remembered(seen: SeenEvents) -> None:
    """Every old id is handled, by exactly the relays that delivered it; nothing else is."""
    await seen.lookup([i for i, _, _ in OLD_ROWS] + ["02" * 32])
    for event_id, relays, _ in OLD_ROWS:
        for relay in relays.split():
            assert seen.first_delivery(event_id, relay, {}) == (False, False)
        assert seen.first_delivery(event_id, "wss://new", {}) == (False, True)
    assert seen.delivered_by(LEGACY[0], LEGACY[1])
    assert seen.first_delivery("02" * 32, "wss://a", {}) == (True, True)


async def test_sqlite_0014_moves_every_seen_id_and_its_relays(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    connection = sqlite_at(path, PACKED - 1)
    try:
        connection.executemany(
            "INSERT INTO seen_events (event_id, relay, keep_until) VALUES (?, ?, ?)", OLD_ROWS
        )
        connection.execute(
            "INSERT INTO seen_on_relay (event_id, relay, keep_until) VALUES (?, ?, ?)", LEGACY
        )
    finally:
        connection.close()
    db = await open_database(path)
    try:
        rows = SqliteSeenRows(db)
        await _assert_remembered(SeenEvents(rows, 1000, 10))
        warmed = SeenEvents(rows, 1000, 10)
        await warmed.load()
        assert all(warmed.known(i) for i, _, _ in OLD_ROWS)
        # new rows go in with the moved ones, as bytes, and prune by keep_until alone
        await warmed.save([("02" * 32, ("wss://a",), 1_500_000, 0)], [("ff" * 32, "wss://e")])
        assert await warmed.prune(now=1_500) == 1
    finally:
        await db.close()
    with sqlite3.connect(path) as check:
        stored = check.execute(
            "SELECT id, event_id, relay, keep_until FROM seen_events ORDER BY id"
        ).fetchall()
        table_sql = check.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'seen_events'"
        ).fetchone()[0]
    # moved in keep_until order, ids as 32 bytes; the new row appended after them
    assert stored == [
        (2, bytes.fromhex("ab" * 32), "wss://a wss://b", 2_000),
        (3, bytes.fromhex("ff" * 32), "wss://c wss://e", 3_000),
        (4, bytes.fromhex("02" * 32), "wss://a", 2_500),
    ]
    assert "WITHOUT ROWID" not in table_sql.upper()


async def test_sqlite_0014_refuses_a_malformed_id_and_changes_nothing(tmp_path: Path) -> None:
    """Ids were validated hex before they were stored; a row that is not fails the migration
    whole (the database stays at the version before, readable by the release before)."""
    path = tmp_path / "odd.db"
    connection = sqlite_at(path, PACKED - 1)
    try:
        connection.execute(
            "INSERT INTO seen_events (event_id, relay, keep_until) VALUES ('zz', 'wss://a', 1)"
        )
    finally:
        connection.close()
    with pytest.raises(MigrationError, match="0014"):
        await open_database(path)
    with sqlite3.connect(path) as check:
        assert check.execute("SELECT event_id FROM seen_events").fetchall() == [("zz",)]
        assert check.execute("SELECT max(version) FROM schema_migrations").fetchone()[0] < PACKED


async def test_postgres_0014_moves_every_seen_id_and_its_relays(postgres_url: str) -> None:
    migrations = available()
    connection = await asyncpg.connect(postgres_url)
    try:
        await migrate_connection(connection, [m for m in migrations if m.version < PACKED])
        await connection.executemany(
            "INSERT INTO seen_events (event_id, relay, keep_until) VALUES ($1, $2, $3)", OLD_ROWS
        )
        await connection.execute(
            "INSERT INTO seen_on_relay (event_id, relay, keep_until) VALUES ($1, $2, $3)",
            *LEGACY,
        )
        await migrate_connection(connection)
        stored = await connection.fetch("SELECT event_id FROM seen_events ORDER BY keep_until")
        assert [bytes(r[0]) for r in stored] == [bytes.fromhex(i) for i in ("01" * 32, "ab" * 32,
                                                                             "ff" * 32)]
    finally:
        await connection.close()
    db = PostgresDatabase(await asyncpg.connect(postgres_url))
    try:
        rows = PostgresSeenRows(db)
        await _assert_remembered(SeenEvents(rows, 1000, 10))
        warmed = SeenEvents(rows, 1000, 10)
        await warmed.load()
        assert all(warmed.known(i) for i, _, _ in OLD_ROWS)
        assert await warmed.prune(now=1_500) == 1
    finally:
        await db.close()
