"""One catch-up row per DM and recipient (migration 0016, issue 23's ingest with copies).

Releases before it wrote a `catchup_items` row per relay's copy of a DM. 0016 moves them into
one row per (recipient, event id) listing every relay that delivered it: each relay reads back
exactly what it delivered, a restart past a snapshot's cut still finds the rows noted after
it, and the window prunes as before.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg

from sigil_push.store.interface import CatchupItemsStore
from sigil_push.store.postgres.bridge_state import PostgresCatchupItems
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.migrate import available, migrate_connection
from sigil_push.store.sqlite.bridge_state import SqliteCatchupItems
from sigil_push.store.sqlite.database import open_database
from testkit.old_schema import sqlite_at

BY_DM = 16
ALICE, BOB = "0a" * 32, "0b" * 32
DM, OTHER_DM = "ab" * 32, "cd" * 32
OLD_ROWS = [
    ("wss://a", ALICE, DM, 2_000, 10),
    ("wss://b", ALICE, DM, 2_000, 30),
    ("wss://a", BOB, DM, 2_000, 10),
    ("wss://b", "", OTHER_DM, 1_000, 20),
    ("wss://c", "", OTHER_DM, 1_000, 20),
]
"""(relay, recipient, event id, created_at, noted_at) as 0014 stored them, ids as bytes;
'' is a firehose DM for nobody here."""


def _packed(rows: list[tuple[str, str, str, int, int]]) -> list[tuple[str, bytes, bytes, int, int]]:
    return [(r, bytes.fromhex(p), bytes.fromhex(e), at, noted) for r, p, e, at, noted in rows]


async def _assert_moved(items: CatchupItemsStore) -> None:
    """Every relay reads back what it delivered, whole, by key and past a cut; new rows join
    the moved ones; the window prunes one row per recipient and DM."""
    assert sorted(await items.rows("wss://a", None, 0)) == [(ALICE, DM, 2_000), (BOB, DM, 2_000)]
    assert sorted(await items.rows("wss://b", None, 0)) == [
        ("", OTHER_DM, 1_000), (ALICE, DM, 2_000)
    ]
    assert await items.items("wss://c", None, 0) == {OTHER_DM: 1_000}
    assert await items.items("wss://b", [BOB], 0) == {}
    assert await items.noted_since("wss://b", 25, 0) == [(ALICE, DM, 2_000)]
    assert await items.noted_since("wss://a", 25, 0) == [(ALICE, DM, 2_000)], (
        "the row's noted_at is its last relay's: read again past the cut, never missed"
    )
    await items.add([("wss://c", BOB, DM, 2_000)])
    assert await items.items("wss://c", [BOB], 0) == {DM: 2_000}
    assert await items.prune(1_500) == 1
    assert await items.rows("wss://c", None, 0) == [(BOB, DM, 2_000)]


async def test_sqlite_0016_merges_each_dms_copies_into_one_row(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    connection = sqlite_at(path, BY_DM - 1)
    try:
        connection.executemany(
            "INSERT INTO catchup_items (relay, pubkey, event_id, created_at, noted_at)"
            " VALUES (?, ?, ?, ?, ?)", _packed(OLD_ROWS),
        )
    finally:
        connection.close()
    db = await open_database(path)
    try:
        rows = sorted(await db.execute_fetchall("SELECT pubkey, event_id, relays FROM catchup_items"))
        assert [(bytes(p).hex(), bytes(e).hex(), sorted(r.split())) for p, e, r in rows] == [
            ("", OTHER_DM, ["wss://b", "wss://c"]),
            (ALICE, DM, ["wss://a", "wss://b"]),
            (BOB, DM, ["wss://a"]),
        ]
        await _assert_moved(SqliteCatchupItems(db))
    finally:
        await db.close()
    with sqlite3.connect(path) as check:
        indexes = {row[1] for row in check.execute("PRAGMA index_list(catchup_items)")}
    assert {"catchup_items_by_time", "catchup_items_by_noted"} <= indexes


async def test_postgres_0016_merges_each_dms_copies_into_one_row(postgres_url: str) -> None:
    migrations = available()
    connection = await asyncpg.connect(postgres_url)
    try:
        await migrate_connection(connection, [m for m in migrations if m.version < BY_DM])
        await connection.executemany(
            "INSERT INTO catchup_items (relay, pubkey, event_id, created_at, noted_at)"
            " VALUES ($1, $2, $3, $4, $5)", _packed(OLD_ROWS),
        )
        await migrate_connection(connection)
        rows = await connection.fetch(
            "SELECT pubkey, event_id, relays FROM catchup_items ORDER BY pubkey, event_id"
        )
        assert [(bytes(r[0]).hex(), bytes(r[1]).hex(), r[2]) for r in rows] == [
            ("", OTHER_DM, "wss://b wss://c"),
            (ALICE, DM, "wss://a wss://b"),
            (BOB, DM, "wss://a"),
        ]
    finally:
        await connection.close()
    db = PostgresDatabase(await asyncpg.connect(postgres_url))
    try:
        await _assert_moved(PostgresCatchupItems(db))
    finally:
        await db.close()
