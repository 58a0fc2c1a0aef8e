"""The event JSON of `event` and `sealed` wakeups lives apart from the outbox row (migration
0015, issue 21), on both engines: written once with its wakeup, read back by the claim for the
rows that carry one, never rewritten by claims, holds or reschedules, and gone with its
wakeup however the wakeup goes (delivered, or its device unregistered). A database at 0014
with queued rows upgrades with every event intact and delivers it.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

import asyncpg
import nostr_sdk
import pytest

from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.factory import PostgresStore, SqliteStore
from sigil_push.store.postgres.migrate import available, migrate_connection
from sigil_push.store.records import Device
from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.fake_fcm import FakeFcm
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush
from testkit.fakes.harness import (
    RELAY,
    Credentials,
    Harness,
    apns_token,
    document,
    eventually,
    provider_tables,
    reset_fakes,
)
from testkit.nostr_client import gift_wrap, kind4_dm
from testkit.old_schema import sqlite_at
from testkit.postgres import PostgresServer
from testkit.stores import fetch, sql_of
from tests.push.test_push_sealed import example

Store = SqliteStore | PostgresStore
NOW = 1_700_000_000_000
BEFORE = 14
"""The last migration before the event JSON moved out of the outbox row."""


def _event(text: str = "x") -> Event:
    return sign_event(SecretKey.generate(), 4, text, [["p", "a" * 64]])


async def _device(store: Store, payload: str) -> Device:
    registration = await store.devices.register(
        secrets.token_hex(32), "ios", secrets.token_hex(32), payload, (), None, 0,
        device_key=SecretKey.generate().public_key_hex if payload == "sealed" else None,
    )
    return registration.device


async def _events_kept(store: Store) -> list[tuple[int, str]]:
    return [(int(r[0]), str(r[1])) for r in await sql_of(store).execute_fetchall(
        "SELECT wakeup_id, event_json FROM outbox_events ORDER BY wakeup_id"
    )]


async def test_only_event_carrying_rows_keep_the_event_and_it_goes_with_them(
    store: Store, store_backend: str
) -> None:
    """A batch mixing modes: one copy of the event per `event`/`sealed` row, under the row's
    id, none for the opaque row (on PostgreSQL a (device, event) queued again adds neither a
    row nor an event); the claim hands each row its event (opaque: None) and a hold or
    reschedule leaves it; a delivered row's event is deleted with it, and so is the event of
    a row whose device is unregistered (the cascade from devices)."""
    outbox = store.outbox
    await outbox.resume(NOW)
    opaque, event_mode, sealed = [await _device(store, mode) for mode in ("opaque", "event", "sealed")]
    event, other = _event("one"), _event("two")
    assert await outbox.enqueue_many([
        (event, "wss://a", NOW, [opaque, event_mode, sealed]), (other, "wss://a", NOW, [sealed]),
    ]) == 4
    due = await outbox.due(NOW, 10)
    by_row = {(w.device_id, w.event_id): w for w in due}
    assert len(by_row) == 4
    assert by_row[opaque.id, event.id].event_json is None
    for device, sent in ((event_mode, event), (sealed, event), (sealed, other)):
        wakeup = by_row[device.id, sent.id]
        assert wakeup.event_json is not None and json.loads(wakeup.event_json) == sent.to_json()
    carrying = sorted(w.id for w in due if w.event_json is not None)
    assert [wakeup_id for wakeup_id, _ in await _events_kept(store)] == carrying

    await outbox.hold([by_row[event_mode.id, event.id].id], NOW)
    await outbox.reschedule([by_row[sealed.id, other.id].id], NOW)
    again = {w.id: w.event_json for w in await outbox.due(NOW, 10)}
    assert again == {by_row[event_mode.id, event.id].id: by_row[event_mode.id, event.id].event_json,
                     by_row[sealed.id, other.id].id: by_row[sealed.id, other.id].event_json}

    await outbox.complete([by_row[opaque.id, event.id].id, by_row[event_mode.id, event.id].id])
    assert [i for i, _ in await _events_kept(store)] == sorted(
        (by_row[sealed.id, event.id].id, by_row[sealed.id, other.id].id)
    )
    assert await store.devices.unregister(sealed.pubkey, sealed.token) == 1
    assert await _events_kept(store) == []
    assert await outbox.depth() == 0
    if store_backend == "postgres":
        assert await outbox.enqueue(other, "wss://a", NOW, [event_mode]) == 1
        assert await outbox.enqueue(other, "wss://b", NOW, [event_mode]) == 0
        [(_, kept)] = await _events_kept(store)
        assert json.loads(kept) == other.to_json()


async def test_the_outbox_row_itself_holds_no_event(store: Store, database: str) -> None:
    """What the claim rewrites is the outbox row: it has a flag and no room for the event."""
    if database.startswith("postgresql://"):
        columns = {r[0] for r in fetch(
            database, "SELECT column_name FROM information_schema.columns"
            " WHERE table_name = 'outbox'"
        )}
    else:
        with sqlite3.connect(database) as connection:
            columns = {r[1] for r in connection.execute("PRAGMA table_info(outbox)")}
    assert "has_event" in columns and "event_json" not in columns


# -- a database from before 0015 -------------------------------------------------------------


class _Queued:
    """Three phones of one account, one per payload mode, each with a DM queued before the
    upgrade (one of them claimed: in flight when the old release stopped)."""

    def __init__(self) -> None:
        self.account = nostr_sdk.Keys.generate()
        self.sender = nostr_sdk.Keys.generate()
        self.device_key = SecretKey.generate()
        self.tokens = {mode: apns_token() for mode in ("opaque", "event", "sealed")}
        self.events = {
            "opaque": kind4_dm(self.sender, self.account, "plain wakeup"),
            "event": kind4_dm(self.sender, self.account, "in clear, as asked"),
            "sealed": gift_wrap(self.sender, self.account, "sealed before the upgrade"),
        }

    def devices(self) -> list[tuple[Any, ...]]:
        pubkey = str(self.account.public_key().to_hex())
        return [
            (number, pubkey, "ios", self.tokens[mode], mode, "[]", 1, 1,
             self.device_key.public_key_hex if mode == "sealed" else None)
            for number, mode in enumerate(("opaque", "event", "sealed"), start=1)
        ]

    def outbox(self) -> list[tuple[Any, ...]]:
        """(id, device_id, event_id, relay, event_json, first_seen_ms, attempts,
        next_attempt_ms, claimed_ms); ids with a gap (an earlier row delivered)."""
        rows = []
        for number, mode in enumerate(("opaque", "event", "sealed"), start=1):
            event = self.events[mode]
            carried = None if mode == "opaque" else json.dumps(event, separators=(",", ":"))
            claimed = 5 if mode == "event" else None
            seen = int(time.time() * 1000)  # recent: an old one would be given up, not sent
            rows.append((number * 2, number, event["id"], RELAY, carried, seen, 0, seen, claimed))
        return rows


_DEVICE_COLUMNS = (
    "id, pubkey, platform, token, payload, relays, registered_at, updated_at, device_key"
)
_OUTBOX_COLUMNS = (
    "id, device_id, event_id, relay, event_json, first_seen_ms, attempts, next_attempt_ms,"
    " claimed_ms"
)


def _sqlite_at_0014(path: Path, queued: _Queued) -> str:
    connection = sqlite_at(path, BEFORE)
    try:
        connection.executemany(
            f"INSERT INTO devices ({_DEVICE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            queued.devices(),
        )
        connection.executemany(
            f"INSERT INTO outbox ({_OUTBOX_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            queued.outbox(),
        )
    finally:
        connection.close()
    return str(path)


async def _postgres_at_0014(server: PostgresServer, queued: _Queued) -> str:
    name = f"at_0014_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(server.url())
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    connection = await asyncpg.connect(server.url(name))
    try:
        await migrate_connection(connection, [m for m in available() if m.version <= BEFORE])
        await connection.executemany(
            f"INSERT INTO devices ({_DEVICE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            queued.devices(),
        )
        await connection.executemany(  # the claim of a worker long gone
            f"INSERT INTO outbox ({_OUTBOX_COLUMNS}, claimed_until_ms, claimed_by)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9,"
            " CASE WHEN $9::bigint IS NULL THEN NULL ELSE 1 END,"
            " CASE WHEN $9::bigint IS NULL THEN NULL ELSE 'gone' END)",
            queued.outbox(),
        )
        for table, last in (("outbox", 6), ("devices", 3)):
            await connection.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), {last})"
            )
    finally:
        await connection.close()
    return server.url(name)


async def test_a_0014_database_upgrades_and_delivers_its_queued_events(
    store_backend: str, tmp_path: Path, request: pytest.FixtureRequest, credentials: Credentials,
    fake_apns: FakeApns, fake_fcm_server: tuple[FakeFcm, Path], fake_up: FakeUnifiedPush,
) -> None:
    """Rows queued before 0015 (opaque, `event`, `sealed`; one claimed at the stop) keep their
    ids and their events, and the real delivery loop sends each with the right payload: the
    event in clear for `event`, sealed to the device for `sealed` (opened with nostr-sdk), a
    bare wakeup for opaque. Once delivered, no event is left behind."""
    queued = _Queued()
    if store_backend == "sqlite":
        database = _sqlite_at_0014(tmp_path / "old.db", queued)
    else:
        database = await _postgres_at_0014(request.getfixturevalue("postgres_server"), queued)
    reset_fakes(fake_apns, fake_fcm_server[0], fake_up)
    harness = Harness(tmp_path, document(provider_tables(credentials, fake_apns, fake_fcm_server)),
                      database)
    await harness.open()
    try:
        assert sorted(w for w, _ in await _events_kept(harness.store)) == [4, 6]
        await harness.start()
        await eventually(harness.drained, what="the queued wakeups delivered")
        bodies = {mode: [r.body for r in fake_apns.requests if r.token == token]
                  for mode, token in queued.tokens.items()}
        [opaque], [in_clear], [sealed] = bodies["opaque"], bodies["event"], bodies["sealed"]
        assert "event" not in opaque and "sealed" not in opaque
        assert json.loads(in_clear["event"]) == queued.events["event"]
        opened = example.open_sealed(sealed, queued.device_key.secret_hex)
        assert opened == {"v": 1, "event": queued.events["sealed"], "relay": RELAY}
        assert await _events_kept(harness.store) == []
        await harness.stop_delivery()
        await harness.enqueue(await harness.devices.of_pubkey(
            str(queued.account.public_key().to_hex())))
        ids = [int(r[0]) for r in await harness.db.execute_fetchall("SELECT id FROM outbox")]
        assert len(ids) == 3 and min(ids) > 6, "ids go on after the migrated rows'"
        assert len(await _events_kept(harness.store)) == 2
    finally:
        await harness.close()
