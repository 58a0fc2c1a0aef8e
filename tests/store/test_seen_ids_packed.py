"""Handled event ids as their 32 bytes, in arrival order (migration 0014, issue 23's ingest).

A DM's `seen_events` row is written in every batch's transaction; the hex ids of the old
WITHOUT ROWID table spread those inserts (and the expiry index's, keyed by one second's
`keep_until` and then the id) over every page. 0014 keeps the same rows with the ids' bytes
under a unique index, in a rowid table on SQLite. The rows a database already holds are moved
whole: every id still de-duplicates, with every relay that delivered it (the legacy
`seen_on_relay` rows included), and is pruned when its time comes.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import asyncpg
import pytest

from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.interface import CatchupItemsStore
from sigil_push.store.postgres.bridge_state import PostgresCatchupItems, PostgresSeenRows
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.migrate import available, migrate_connection
from sigil_push.store.seen import SeenEvents
from sigil_push.store.sqlite.bridge_state import SqliteCatchupItems, SqliteSeenRows
from sigil_push.store.sqlite.database import MigrationError, open_database
from testkit.fakes.harness import eventually as poll
from testkit.in_process import InProcessBridge, in_process_bridge
from testkit.old_schema import sqlite_at
from testkit.stores import Engine, open_test_store, seen_rows

PACKED = 14
OLD_ROWS = [
    ("ab" * 32, "wss://a wss://b", 2_000),
    ("01" * 32, "wss://a", 1_000),
    ("ff" * 32, "wss://c", 3_000),
]
"""(hex id, relays, keep_until) as releases before 0014 wrote them, not in keep_until order."""
CATCHUP_ROWS = [
    ("wss://a", "0a" * 32, "ab" * 32, 2_000),
    ("wss://a", "", "cd" * 32, 1_000),
    ("wss://b", "0a" * 32, "ab" * 32, 2_000),
]
"""(relay, recipient, event id, created_at) as 0010 stored them; '' is a firehose DM for
nobody here."""
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


async def _assert_catchup_rows_kept(items: CatchupItemsStore) -> None:
    """Every relay's deliveries read back as stored, by recipient and whole; a repeat of a
    row is kept once, and the window still prunes by created_at."""
    assert sorted(await items.rows("wss://a", None, 0)) == [
        ("", "cd" * 32, 1_000), ("0a" * 32, "ab" * 32, 2_000),
    ]
    assert await items.items("wss://b", ["0a" * 32, "0c" * 32], 1_500) == {"ab" * 32: 2_000}
    await items.add([("wss://b", "0a" * 32, "ab" * 32, 2_000), ("wss://b", "0c" * 32,
                                                                 "ef" * 32, 3_000)])
    assert await items.items("wss://b", None, 0) == {"ab" * 32: 2_000, "ef" * 32: 3_000}
    assert await items.prune(1_500) == 1
    assert await items.rows("wss://a", [""], 0) == []


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
        connection.execute(
            "INSERT INTO devices (id, pubkey, platform, token, registered_at, updated_at)"
            " VALUES (7, ?, 'android', 'fcm-a', 1, 1)", ("0a" * 32,)
        )
        connection.executemany(
            "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms,"
            " attempts) VALUES (7, ?, 'wss://a', 5, 6, ?)", [("ab" * 32, 2), ("ff" * 32, 0)]
        )
        connection.execute("DELETE FROM outbox WHERE id = 2")  # handed out, settled
        connection.executemany(
            "INSERT INTO catchup_items (relay, pubkey, event_id, created_at) VALUES (?, ?, ?, ?)",
            CATCHUP_ROWS,
        )
    finally:
        connection.close()
    db = await open_database(path)
    try:
        # the queued wakeup kept whole; the next id is not one handed out before (0007)
        assert list(await db.execute_fetchall(
            "SELECT id, device_id, event_id, relay, first_seen_ms, next_attempt_ms, attempts"
            " FROM outbox"
        )) == [(1, 7, "ab" * 32, "wss://a", 5, 6, 2)]
        await db.execute(
            "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
            " VALUES (7, ?, 'wss://a', 7, 7)", ("01" * 32,)
        )
        assert [r[0] for r in await db.execute_fetchall("SELECT id FROM outbox")] == [1, 3]
        await _assert_catchup_rows_kept(SqliteCatchupItems(db))
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
        outbox_indexes = {(r[1], r[2]) for r in check.execute("PRAGMA index_list(outbox)")}
    # moved in keep_until order, ids as 32 bytes; the new row appended after them
    assert stored == [
        (2, bytes.fromhex("ab" * 32), "wss://a wss://b", 2_000),
        (3, bytes.fromhex("ff" * 32), "wss://c wss://e", 3_000),
        (4, bytes.fromhex("02" * 32), "wss://a", 2_500),
    ]
    assert "WITHOUT ROWID" not in table_sql.upper()
    # no index keyed by the random event id; the device's rows still found by device
    assert outbox_indexes == {("outbox_by_device", 0), ("outbox_unclaimed_by_due", 0)}


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
        await connection.executemany(
            "INSERT INTO catchup_items (relay, pubkey, event_id, created_at)"
            " VALUES ($1, $2, $3, $4)", CATCHUP_ROWS,
        )
        await migrate_connection(connection)
        stored = await connection.fetch("SELECT event_id FROM seen_events ORDER BY keep_until")
        assert [bytes(r[0]) for r in stored] == [bytes.fromhex(i) for i in ("01" * 32, "ab" * 32,
                                                                             "ff" * 32)]
    finally:
        await connection.close()
    db = PostgresDatabase(await asyncpg.connect(postgres_url))
    try:
        await _assert_catchup_rows_kept(PostgresCatchupItems(db))
        rows = PostgresSeenRows(db)
        await _assert_remembered(SeenEvents(rows, 1000, 10))
        warmed = SeenEvents(rows, 1000, 10)
        await warmed.load()
        assert all(warmed.known(i) for i, _, _ in OLD_ROWS)
        assert await warmed.prune(now=1_500) == 1
    finally:
        await db.close()


RELAYS = ["ws://127.0.0.1:9", "ws://127.0.0.1:10", "ws://127.0.0.1:11"]
"""Nothing listens: frames are fed to the bridge directly."""


def _frame(event: Event) -> str:
    return json.dumps(["EVENT", "sp0.1", event.to_json()], separators=(",", ":"))


async def test_every_copy_and_a_replay_after_a_restart_wake_each_device_once(
    tmp_path: Path, engine: Engine
) -> None:
    """The outbox keeps no (device, event) constraint on SQLite (0014): the seen ids are what
    hands an event over once. Copies from three relays (one folded into the queued arrival,
    one a batch later) and the same event replayed to a restarted bridge, whose memory of
    seen ids starts cold, give one wakeup per device, on both engines."""
    database = engine.database("push.db")
    relays = [{"url": url, "mode": "firehose"} for url in RELAYS]
    alice, sender = SecretKey.generate(), SecretKey.generate()

    async def wakeups(parts: InProcessBridge) -> list[int]:
        return sorted(w.device_id for w in await parts.store.outbox.due(2**62, 100))

    async with in_process_bridge(tmp_path, database, relays) as parts:
        phones = [
            (await parts.devices.register(alice.public_key_hex, "android", f"fcm-{n}",
                                          "opaque", (), None, 0)).device.id
            for n in range(2)
        ]
        await poll(lambda: all(alice.public_key_hex in parts.bridge._pool.subs[url].keys
                               for url in RELAYS), what="alice watched on every relay")
        # signed after the registration: a firehose wakes a fresh key from then on
        event = sign_event(sender, 4, "hello", [["p", alice.public_key_hex]])
        now_ms = int(time.time() * 1000)
        assert parts.bridge.pool.deliver_text(RELAYS[0], _frame(event), now_ms)
        assert parts.bridge.pool.deliver_text(RELAYS[1], _frame(event), now_ms)
        await poll(lambda: parts.bridge._seen.known(event.id), what="the event committed")
        assert parts.bridge.pool.deliver_text(RELAYS[2], _frame(event), now_ms)
        assert await wakeups(parts) == sorted(phones)
    # a memory of one id: the event is forgotten there once the next one is remembered
    async with in_process_bridge(
        tmp_path, database, relays, bridge={"seen_cache_size": 1}
    ) as parts:
        await poll(lambda: all(alice.public_key_hex in parts.bridge._pool.subs[url].keys
                               for url in RELAYS), what="alice watched again")
        later = [sign_event(sender, 4, f"and again {n}", [["p", alice.public_key_hex]])
                 for n in range(2)]
        now_ms = int(time.time() * 1000)
        assert parts.bridge.pool.deliver_text(RELAYS[0], _frame(later[0]), now_ms)
        await poll(lambda: parts.bridge._seen.known(later[0].id), what="the next event committed")
        assert not parts.bridge._seen.known(event.id), "only the database remembers it"
        for url in RELAYS:
            assert parts.bridge.pool.deliver_text(url, _frame(event), now_ms)
        assert parts.bridge.pool.deliver_text(RELAYS[0], _frame(later[1]), now_ms)
        await poll(lambda: parts.bridge._seen.known(later[1].id), what="the last event committed")
        # claimed by the first `due` above: every row of the first event, once
        rows = await parts.store.outbox.due(2**62, 100)
        assert sorted(w.device_id for w in rows) == sorted(phones * 2)
        assert {w.event_id for w in rows} == {e.id for e in later}
        assert await parts.store.outbox.depth() == 3 * len(phones)


async def test_a_cache_holding_every_row_asks_the_database_nothing(database: str) -> None:
    """On SQLite (one process owns the file) a cache loaded with every row there is, and fed
    every row written since, answers for the database: a row that only the database holds
    (no writer of this build makes one) is not looked up, until the cache first forgets
    ids. On PostgreSQL other workers write rows too: the database is always asked."""
    store = await open_test_store(database)
    try:
        rows = seen_rows(store)
        seen = SeenEvents(rows, 1000, 10)
        await seen.load()
        behind = ("0b" * 32, "wss://elsewhere", 2**40)
        await rows.insert([(bytes.fromhex(behind[0]), behind[1], behind[2])])
        await seen.lookup([behind[0]])
        asked = not seen.first_delivery(behind[0], "wss://a", {})[0]
        assert asked == (not rows.sole_writer)
        for n in range(20):  # past the cache's size: its oldest ids are dropped
            decided: dict[str, tuple[str, ...]] = {}
            seen.first_delivery(f"{n:064x}", "wss://a", decided)
            await seen.save([(f"{n:064x}", ("wss://a",), 0, 0)], [])
            seen.remember(decided)
        await seen.lookup([behind[0]])
        assert seen.delivered_by(behind[0], "wss://elsewhere")
        assert not seen.known(f"{0:064x}")
        await seen.lookup([f"{0:064x}"])
        assert seen.known(f"{0:064x}"), "a forgotten id is found in the database again"
    finally:
        await store.close()
