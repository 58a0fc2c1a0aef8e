"""What the ingest's hot path reads of the users' lists (issue 20's cost), both engines.

Which lists an npub has is on its pairs' own rows (`devices.list_flags`, migration 0011): the
device read of every DM reads that one row and asks `user_lists` nothing (the subquery it
replaced made a device read 6.8 instead of 5.2 us with 20,000 lists stored). The flags follow
lists and pairs however they are written, and 0011 sets them on a database that already holds
lists, keeping every value. A kind 4's author checks read only the lists the pairs' rules use:
a kind 3 for follows-only alone.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import asyncpg

from sigil_push.bridge.user_lists import user_list_of
from sigil_push.config import parse_config
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.factory import PostgresStore, SqliteStore, connect_bridge
from sigil_push.store.interface import BridgeConnection
from sigil_push.store.postgres.migrate import available, migrate_connection
from sigil_push.store.preferences import list_owners
from sigil_push.store.records import Device, PreferenceChange, Rules, pack_keys
from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.devices import Devices
from testkit.old_schema import sqlite_at
from testkit.rules import dm_checks, reason_of
from testkit.stores import sql_of


def _key() -> str:
    return os.urandom(32).hex()


async def _link(tmp_path: Path, database: str) -> BridgeConnection:
    return await connect_bridge(parse_config({"server": {"database": database}},
                                             tmp_path / "relays.toml"))


def _device(device_id: int, pubkey: str, senders: str) -> Device:
    """A pair whose npub has a kind 10000 with keys and a kind 3, as the device read gives it."""
    return Device(device_id, pubkey, "ios", _key(), "opaque", (), None, 0,
                  rules=Rules(None, senders, None, 0, True, True))


def test_a_kind_3_is_read_for_follows_only_pairs_alone() -> None:
    """Most users have a kind 3, often of thousands of keys: one who mutes but takes DMs from
    anyone has only the kind 10000 read for a kind 4's author check."""
    anyone, follows = _key(), _key()
    assert list_owners([_device(1, anyone, "anyone"), _device(2, follows, "follows")]) == (
        sorted([anyone, follows]), [follows],
    )


async def test_the_author_checks_read_the_kinds_asked_for(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """Two npubs each with both lists stored: the read for one's kind 10000 and the other's
    kind 3 returns those two lists and nothing else; the verdicts follow the rules."""
    mutes, follows = SecretKey.generate(), SecretKey.generate()
    muted, friend = _key(), _key()
    quiet = (await store.devices.register(mutes.public_key_hex, "ios", _key(), "opaque", (),
                                          None, 0)).device
    picky = (await store.devices.register(follows.public_key_hex, "ios", _key(), "opaque",
                                          (), None, 0)).device
    link = await _link(tmp_path, database)
    try:
        now = int(time.time())
        async with link.transaction():
            await link.lists.save([
                user_list_of(sign_event(owner, kind, "", [["p", key]], now))
                for owner in (mutes, follows) for kind, key in ((10000, muted), (3, friend))
            ])
        # the engine's read itself: what a group of checks fetches
        read = await link.lists._lists_of(  # type: ignore[attr-defined]
            [mutes.public_key_hex], [follows.public_key_hex]
        )
        assert sorted(read) == sorted([(mutes.public_key_hex, 10000), (follows.public_key_hex, 3)])
        await store.devices.set_preferences(follows.public_key_hex, picky.token,
                                            PreferenceChange(senders="follows"))
        [quiet] = await store.devices.of_pubkey(mutes.public_key_hex)
        [picky] = await store.devices.of_pubkey(follows.public_key_hex)
        assert await link.lists.blocked(dm_checks([(muted, [quiet]), (friend, [quiet]),
                                                   (muted, [picky]), (_key(), [picky])]),
                                        reason_of) == [
            {quiet.id: "muted"}, {}, {picky.id: "muted"}, {picky.id: "not_followed"},
        ]
    finally:
        await link.close()


async def test_the_device_read_takes_the_lists_from_the_pair_alone(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """Once a list is stored, its npub's pairs say so by themselves: the device read finds
    the flags on the row even with `user_lists` emptied behind the store's back (the read
    looks at no other table); registering the pair again takes the flags anew from the
    stored lists."""
    owner = SecretKey.generate()
    token = _key()
    device = (await store.devices.register(owner.public_key_hex, "ios", token, "opaque", (),
                                           None, 0)).device
    link = await _link(tmp_path, database)
    try:
        now = int(time.time())
        async with link.transaction():
            await link.lists.save([
                user_list_of(sign_event(owner, 10000, "", [["p", _key()]], now)),
                user_list_of(sign_event(owner, 3, "", [["p", _key()]], now)),
            ])
    finally:
        await link.close()
    await sql_of(store).execute("DELETE FROM user_lists")
    [read] = await store.devices.of_pubkeys([owner.public_key_hex])
    assert read.id == device.id and read.rules is not None
    assert (read.rules.mute_list, read.rules.follows_known) == (True, True)
    again = await store.devices.register(owner.public_key_hex, "ios", token, "opaque", (), None, 0)
    assert not again.created
    assert (await store.devices.by_id(device.id)).rules is None  # type: ignore[union-attr]


# -- migration 0011 ---------------------------------------------------------------------------

_OWNER, _BYSTANDER = "a" * 64, "b" * 64
_PRIVATE = pack_keys([_key() for _ in range(200)])
"""6,400 bytes: longer than a SQLite page, so it lies in overflow pages."""
_PAIRS = [
    (3, _OWNER, "ios", "ab" * 32, "opaque", "[]", 1_700_000_000, 1_700_000_100, _PRIVATE, 200),
    (8, _BYSTANDER, "android", "cd" * 32, "opaque", "[]", 1_700_000_200, 1_700_000_200, None, 0),
]
_PAIR_COLUMNS = (
    "id, pubkey, platform, token, payload, relays, registered_at, updated_at, muted, muted_count"
)
_LISTS = [
    (_OWNER, 10000, 1_700_000_000, "e" * 64, pack_keys([_key()]), 1),
    (_OWNER, 3, 1_700_000_000, "f" * 64, pack_keys([_key(), _key()]), 2),
    (_BYSTANDER, 10000, 1_700_000_000, "d" * 64, b"", 0),
]
_LIST_COLUMNS = "pubkey, kind, created_at, event_id, entries, entry_count"


async def test_sqlite_0011_flags_the_pairs_of_stored_lists_and_keeps_muted_last(
    tmp_path: Path,
) -> None:
    """0011 on a database at 0010: the pair whose npub has a kind 10000 with keys and a kind 3
    gets both flags, the one whose kind 10000 is empty none; every value stays, and `muted`
    is still the last column (reading the ones before it never walks its overflow pages)."""
    path = tmp_path / "old.db"
    connection = sqlite_at(path, 10)
    try:
        connection.executemany(
            f"INSERT INTO devices ({_PAIR_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", _PAIRS
        )
        connection.executemany(
            f"INSERT INTO user_lists ({_LIST_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)", _LISTS
        )
    finally:
        connection.close()
    db = await open_database(path)
    try:
        owner, bystander = [await Devices(db).by_id(3), await Devices(db).by_id(8)]
    finally:
        await db.close()
    assert owner is not None and owner.rules is not None
    assert (owner.rules.mute_list, owner.rules.follows_known, owner.rules.muted_count) == (
        True, True, 200,
    )
    assert bystander is not None and bystander.rules is None
    with sqlite3.connect(path) as connection:
        rows = [tuple(r) for r in connection.execute(
            f"SELECT {_PAIR_COLUMNS}, list_flags FROM devices ORDER BY id"
        )]
        columns = [r[1] for r in connection.execute("PRAGMA table_info(devices)")]
    assert rows == [(*_PAIRS[0], 3), (*_PAIRS[1], 0)]
    assert columns[-1] == "muted" and "muted_last" not in columns


async def test_postgres_0011_flags_the_pairs_of_stored_lists(postgres_url: str) -> None:
    migrations = available()
    connection = await asyncpg.connect(postgres_url)
    try:
        await migrate_connection(connection, [m for m in migrations if m.version < 11])
        await connection.executemany(
            f"INSERT INTO devices ({_PAIR_COLUMNS})"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            _PAIRS,
        )
        await connection.executemany(
            f"INSERT INTO user_lists ({_LIST_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)", _LISTS
        )
        applied = await migrate_connection(connection)
        assert applied == [m.name for m in migrations if m.version >= 11]
        rows = await connection.fetch(
            f"SELECT {_PAIR_COLUMNS}, list_flags FROM devices ORDER BY id"
        )
        assert [tuple(r) for r in rows] == [(*_PAIRS[0], 3), (*_PAIRS[1], 0)]
    finally:
        await connection.close()
