"""Sealed previews, the registration side (issue 21): `device_key`, `payload: "sealed"`, the
`sealed` flag of GET /registrations, and migration 0008 on both engines.

The API tests use the shared service (`api`), which runs once on SQLite and once on PostgreSQL.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path

import asyncpg
import pytest

from sigil_push.nostr.keys import SecretKey
from sigil_push.store.postgres.devices import PostgresDevices
from sigil_push.store.postgres.migrate import available, migrate_connection
from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.devices import Devices
from testkit.nip98 import SdkUser
from testkit.old_schema import sqlite_at
from testkit.service import ServiceProcess
from tests.conftest import ApiCaller

BAD_KEYS = [
    "ff" * 32,  # no point: above the field size
    "1234567890abcdef1234567890abcdef1234567890abcdef1234567890abcdef",  # x with no square root
    "00" * 32,  # a point on the twist, not on secp256k1
    "AB" * 32,  # upper case
    "ab" * 31,  # too short
    "ab" * 33,  # too long
    "npub1" + "q" * 58,  # an npub, not hex
    "",
    7,
    ["ab" * 32],
]


def _token() -> str:
    return secrets.token_hex(32)


def _device_key() -> str:
    return SecretKey.generate().public_key_hex


def test_a_sealed_registration_is_listed_as_sealed_without_its_key(
    api: ApiCaller, service: ServiceProcess
) -> None:
    """201 echoes `payload: sealed`; GET /registrations says `sealed: true`, and the key appears
    neither there nor in the service's log."""
    user, token, key = SdkUser(), _token(), _device_key()
    response = api.register(user, device_token=token, payload="sealed", device_key=key)
    assert response.status_code == 201, response.text
    assert response.json()["payload"] == "sealed"
    assert key not in response.text
    listing = api.call("GET", "/registrations", user)
    [device] = listing.json()["devices"]
    assert (device["payload"], device["sealed"]) == ("sealed", True)
    assert key not in listing.text
    assert key not in service.log()


def test_a_registration_without_a_key_is_not_sealed(api: ApiCaller) -> None:
    user = SdkUser()
    assert api.register(user, device_token=_token()).status_code == 201
    [device] = api.call("GET", "/registrations", user).json()["devices"]
    assert device["sealed"] is False


def test_sealed_without_a_device_key_is_invalid_payload(api: ApiCaller) -> None:
    user = SdkUser()
    response = api.register(user, device_token=_token(), payload="sealed")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_payload"
    assert api.call("GET", "/registrations", user).json()["devices"] == []


@pytest.mark.parametrize("key", BAD_KEYS, ids=range(len(BAD_KEYS)))
def test_a_bad_device_key_is_refused_and_nothing_is_stored(api: ApiCaller, key: object) -> None:
    """Syntax first, then whether the x coordinate lifts to a point: a key nobody holds the
    secret of would make every sealed push unreadable."""
    user = SdkUser()
    response = api.register(user, device_token=_token(), payload="sealed", device_key=key)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_device_key"
    assert api.call("GET", "/registrations", user).json()["devices"] == []


def test_registering_again_without_the_key_clears_it(api: ApiCaller) -> None:
    """An update replaces the registration as sent: no key, no sealing (and a key may be set
    on a registration whose payload is still opaque, ready for the switch)."""
    user, token = SdkUser(), _token()
    api.register(user, device_token=token, device_key=_device_key())
    # an auth event a second older: the second listing's auth may fall in the same second
    # with the same tags, which would be the same event id, refused as a replay
    earlier = user.header(api.public_url + "/registrations", "GET", created_at=int(time.time()) - 2)
    listing = api.call("GET", "/registrations", None, headers={"authorization": earlier})
    [device] = listing.json()["devices"]
    assert (device["payload"], device["sealed"]) == ("opaque", True)
    assert api.register(user, device_token=token, payload="sealed", device_key=_device_key()).status_code == 200
    assert api.register(user, device_token=token, payload="event_id").status_code == 200
    [device] = api.call("GET", "/registrations", user).json()["devices"]
    assert (device["payload"], device["sealed"]) == ("event_id", False)


# -- migration 0008 ---------------------------------------------------------------------------

_OLD_ROWS = [
    (3, "a" * 64, "ios", "ab" * 32, "event", '["wss://inbox.example"]', None, None,
     1_700_000_000, 1_700_000_100),
    (8, "b" * 64, "unifiedpush", "https://push.example/x", "opaque", "[]", "p256", "auth",
     1_700_000_200, 1_700_000_200),
]
_OLD_COLUMNS = (
    "id, pubkey, platform, token, payload, relays, webpush_p256dh, webpush_auth, registered_at,"
    " updated_at"
)


def _sqlite_at_0007(path: Path) -> None:
    connection = sqlite_at(path, 7)
    try:
        connection.executemany(
            f"INSERT INTO devices ({_OLD_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", _OLD_ROWS
        )
    finally:
        connection.close()


async def test_sqlite_migration_keeps_existing_rows_unsealed(tmp_path: Path) -> None:
    """0008 on a database from before it: every row keeps every value, and none has a key."""
    path = tmp_path / "old.db"
    _sqlite_at_0007(path)
    db = await open_database(path)
    try:
        devices = Devices(db)
        old = [await devices.by_id(3), await devices.by_id(8)]
        assert [d.device_key for d in old if d is not None] == [None, None]
        assert [(d.payload, d.relays) for d in old if d is not None] == [
            ("event", ("wss://inbox.example",)), ("opaque", ()),
        ]
        key = _device_key()
        sealed = await devices.register("c" * 64, "ios", _token(), "sealed", (), None, 0,
                                        device_key=key)
        assert sealed.device.device_key == key
    finally:
        await db.close()
    with sqlite3.connect(path) as connection:
        rows = [tuple(r) for r in connection.execute(
            f"SELECT {_OLD_COLUMNS}, device_key FROM devices WHERE id IN (3, 8) ORDER BY id"
        )]
    assert rows == [(*row, None) for row in _OLD_ROWS]


async def test_postgres_migration_keeps_existing_rows_unsealed(postgres_url: str) -> None:
    migrations = available()
    connection = await asyncpg.connect(postgres_url)
    try:
        await migrate_connection(connection, [m for m in migrations if m.version < 8])
        await connection.executemany(
            f"INSERT INTO devices ({_OLD_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            _OLD_ROWS,
        )
        applied = await migrate_connection(connection)
        assert applied == [m.name for m in migrations if m.version >= 8]
        rows = await connection.fetch(
            f"SELECT {_OLD_COLUMNS}, device_key FROM devices ORDER BY id"
        )
        assert [tuple(r) for r in rows] == [(*row, None) for row in _OLD_ROWS]
    finally:
        await connection.close()


async def test_both_engines_store_and_return_the_key(store: object) -> None:
    """Through the store interface: a key set, read back by id and by pubkey, and cleared by an
    update that sends none."""
    devices = store.devices  # type: ignore[attr-defined]
    assert isinstance(devices, (Devices, PostgresDevices))
    pubkey, token, key = _device_key(), _token(), _device_key()
    first = await devices.register(pubkey, "ios", token, "sealed", (), None, 0, device_key=key)
    assert first.created and first.device.device_key == key
    [listed] = await devices.of_pubkey(pubkey)
    assert listed.device_key == key
    again = await devices.register(pubkey, "ios", token, "opaque", (), None, 0)
    assert not again.created and again.device.device_key is None
