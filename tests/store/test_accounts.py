"""Several accounts on one device (issue 10): a registration is an (npub, device token) pair.

End to end with real parts: a `nostr-relay` process, a `sigil-push serve` process sending to
the local fake FCM server, nostr-sdk users who register with their own NIP-98 and send each
other real NIP-04 DMs. Then the delivery loop alone against the fake APNs (payload modes and
batch boundaries). Both run once on SQLite and once on PostgreSQL. Last, the migrations of an
existing database, one test per engine (each engine has its own migration files).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from sigil_push.config import ConfigError, parse_config
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import now_ms
from sigil_push.store.postgres.migrate import available, migrate_connection
from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.devices import Devices
from sigil_push.store.sqlite.outbox import Outbox
from testkit.bridge_harness import assert_private, relay_live
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.fake_fcm import FakeFcm
from testkit.fakes.harness import (
    RELAY,
    apns_token,
    eventually,
    fcm_token,
    toml_tables,
)
from testkit.nip98 import SdkUser
from testkit.nostr_client import kind4_dm, publish
from testkit.old_schema import sqlite_at
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import BACKENDS, backend_service, fetch
from tests.conftest import ApiCaller

WINDOW_MS = 15_000
"""Long enough that two DMs published together are both on disk before the window that the
first push opened has ended (so the assertion does not hang on the machine's speed)."""
CAP = 3
NO_RATE_LIMITS = "requests_per_minute_per_ip = 0\nrequests_per_minute_per_npub = 0\n"


class Instance:
    """One relay, one service sending to the fake FCM, and an authenticated HTTP client."""

    def __init__(self, relay: RelayProcess, service: ServiceProcess, fcm: FakeFcm) -> None:
        self.relay, self.service, self.fcm = relay, service, fcm
        self.http = httpx.Client(base_url=service.url, timeout=scaled(REQUEST_SECONDS))
        self.api = ApiCaller(self.http, service.url)

    def register(self, user: SdkUser, token: str, **fields: Any) -> httpx.Response:
        return self.api.register(user, platform="android", device_token=token, **fields)

    def devices(self, user: SdkUser) -> list[dict[str, Any]]:
        listing = self.api.call("GET", "/registrations", user)
        assert listing.status_code == 200, listing.text
        return list(listing.json()["devices"])

    def messages_to(self, token: str) -> list[dict[str, Any]]:
        return [m for m in self.fcm.messages if m["token"] == token]

    def push_records(self, event_id: str) -> list[dict[str, Any]]:
        return [
            r for r in self.service.observation_records()
            if r["type"] == "push" and r["event_id"] == event_id
        ]


@pytest.fixture(scope="module", params=BACKENDS)
def instance(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    fake_fcm_server: tuple[FakeFcm, Path],
) -> Iterator[Instance]:
    """One instance per engine, shared by the module's end-to-end stories."""
    folder = tmp_path_factory.mktemp(f"accounts-{request.param}")
    relay = RelayProcess(folder / "relay").start()
    fake, service_account = fake_fcm_server
    fcm_table = {"credentials_file": str(service_account), "endpoint": fake.url}
    service = backend_service(request.param, request, ServiceProcess(
        folder / "service",
        [relay.url],
        extra_toml=FAST_RECONNECT + toml_tables({"fcm": fcm_table}),
        limits=f"{NO_RATE_LIMITS}coalesce_window_ms = {WINDOW_MS}\naccounts_per_device = {CAP}",
    ))
    try:
        service.start()
        running = Instance(relay, service, fake_fcm_server[0])
        yield running
        running.http.close()
    finally:
        service.stop()
        relay.stop()


async def _subscribed(instance: Instance, keys: int) -> None:
    await eventually(lambda: relay_live(instance.service, instance.relay.url, keys),
                     timeout=30.0, what=f"the relay subscribed for {keys} keys")


@pytest.mark.slow
async def test_two_accounts_on_one_phone_get_one_push_for_dms_inside_the_window(
    instance: Instance,
) -> None:
    """Alice and Bob share a phone. A first DM to Alice is pushed at once and opens the
    coalescing window; DMs to both, sent inside it, then arrive at FCM as exactly one more
    push: opaque, carrying no key or content, one answer for both events."""
    alice, bob, sender, token = SdkUser(), SdkUser(), SdkUser(), fcm_token()
    assert instance.register(alice, token).status_code == 201
    assert instance.register(bob, token).status_code == 201
    await _subscribed(instance, 2)

    first = kind4_dm(sender.keys, alice.keys, "first")
    await publish(instance.relay.url, first)
    await eventually(lambda: instance.messages_to(token), timeout=30.0, what="the first push")
    to_alice = kind4_dm(sender.keys, alice.keys, "lunch at noon?")
    to_bob = kind4_dm(sender.keys, bob.keys, "the keys are under the mat")
    await publish(instance.relay.url, to_alice, to_bob)

    await eventually(
        lambda: instance.push_records(to_alice["id"]) and instance.push_records(to_bob["id"]),
        timeout=WINDOW_MS / 1000 + 30.0, what="both DMs pushed",
    )
    messages = instance.messages_to(token)
    assert len(messages) == 2, "one push for the first DM, one for both DMs in its window"
    assert [m["data"] for m in messages] == [{"type": "wakeup"}, {"type": "wakeup"}]
    [alice_record] = instance.push_records(to_alice["id"])
    [bob_record] = instance.push_records(to_bob["id"])
    assert alice_record["ts"] == bob_record["ts"] and alice_record["status"] == "accepted"
    wire = json.dumps(messages)
    for private in (alice.hex, alice.npub, bob.hex, bob.npub, sender.hex, "lunch", "mat"):
        assert private not in wire
    assert_private(instance.service, [alice.hex, alice.npub, bob.hex, bob.npub, token,
                                      "lunch at noon?", to_bob["content"]])


@pytest.mark.slow
async def test_unregistering_one_account_keeps_the_other(instance: Instance) -> None:
    """Carol signs out of Dave's phone: Dave's registration and wakeups stay, Carol's go."""
    carol, dave, sender, token = SdkUser(), SdkUser(), SdkUser(), fcm_token()
    base = len(_all_keys(instance))
    instance.register(carol, token)
    instance.register(dave, token)
    await _subscribed(instance, base + 2)

    removed = instance.api.call("DELETE", "/unregister", carol, {"device_token": token})
    assert removed.json() == {"removed": 1}
    assert instance.devices(carol) == []
    [kept] = instance.devices(dave)
    assert kept["token_suffix"] == token[-6:]
    await _subscribed(instance, base + 1)

    to_carol = kind4_dm(sender.keys, carol.keys, "for carol")
    to_dave = kind4_dm(sender.keys, dave.keys, "for dave")
    await publish(instance.relay.url, to_carol, to_dave)
    await eventually(lambda: instance.push_records(to_dave["id"]), timeout=30.0,
                     what="Dave's DM pushed")
    assert len(instance.messages_to(token)) == 1
    assert instance.push_records(to_carol["id"]) == []


@pytest.mark.slow
async def test_a_dead_token_removes_every_account(instance: Instance) -> None:
    """FCM answers UNREGISTERED to a push for Erin: Frank's pair on the same token goes too."""
    erin, frank, sender, token = SdkUser(), SdkUser(), SdkUser(), fcm_token()
    base = len(_all_keys(instance))
    instance.register(erin, token)
    instance.register(frank, token, payload="event_id")
    await _subscribed(instance, base + 2)
    instance.fcm.script.answers[token] = ("UNREGISTERED", None)
    try:
        dm = kind4_dm(sender.keys, erin.keys, "hello")
        await publish(instance.relay.url, dm)
        await eventually(lambda: _pairs(instance, token) == 0, timeout=30.0,
                         what="both registrations forgotten")
        assert instance.devices(erin) == [] and instance.devices(frank) == []
        await eventually(lambda: instance.push_records(dm["id"]), what="the push recorded")
        assert [r["status"] for r in instance.push_records(dm["id"])] == ["unregistered"]
    finally:
        del instance.fcm.script.answers[token]


@pytest.mark.slow
def test_the_account_cap_is_enforced_with_a_clear_error(instance: Instance) -> None:
    """A fourth npub on a token capped at three is refused with 409 too_many_accounts; the
    three registered accounts can still update their own registrations."""
    token = fcm_token()
    owners = [SdkUser() for _ in range(CAP)]
    for owner in owners:
        assert instance.register(owner, token).status_code == 201
    refused = instance.register(SdkUser(), token)
    assert refused.status_code == 409
    assert refused.json()["error"] == "too_many_accounts"
    assert str(CAP) in refused.json()["message"]
    assert instance.register(owners[0], token, payload="event_id").status_code == 200


def _pairs(instance: Instance, token: str) -> int:
    """Registrations of `token` in the service's database (polled there: a NIP-98 event can
    be spent once, and two polls within one second would sign the same one)."""
    [(pairs,)] = fetch(instance.service.database, "SELECT COUNT(*) FROM devices WHERE token = ?",
                       (token,))
    return int(pairs)


def _all_keys(instance: Instance) -> list[str]:
    """Registered pubkeys in the service's database (the relay's key count builds on them)."""
    return [row[0] for row in fetch(instance.service.database, "SELECT DISTINCT pubkey FROM devices")]


# -- the delivery loop alone ----------------------------------------------------------------


def _apns_to(fake: FakeApns, token: str) -> list[Any]:
    return [r for r in fake.requests if r.token == token]


async def test_opaque_accounts_share_a_push_and_event_id_accounts_keep_their_own(
    make_harness, fake_apns: FakeApns
) -> None:
    """Three accounts on one iPhone, one DM each: the two opaque ones travel in one push; the
    `event_id` account gets its own push naming its event."""
    harness = await make_harness(limits={"coalesce_window_ms": 2000}, start=False)
    token = apns_token()
    accounts = [SecretKey.generate() for _ in range(3)]
    devices = [
        (await harness.devices.register(key.public_key_hex, "ios", token, mode, (), None, 0)).device
        for key, mode in zip(accounts, ("opaque", "opaque", "event_id"), strict=True)
    ]
    events = [
        sign_event(harness.sender_key, 4, f"to account {i}", [["p", key.public_key_hex]])
        for i, key in enumerate(accounts)
    ]
    for event, device in zip(events, devices, strict=True):
        await harness.enqueue([device], event)
    await harness.start()

    await eventually(lambda: len(harness.push_records()) == 3, what="three push records")
    bodies = [r.body for r in _apns_to(fake_apns, token)]
    assert len(bodies) == 2
    assert [b.get("event_id") for b in bodies if "event_id" in b] == [events[2].id]
    assert [set(b) for b in bodies if "event_id" not in b] == [{"aps"}]


async def test_a_batch_boundary_never_splits_one_phones_wakeups(
    make_harness, fake_apns: FakeApns
) -> None:
    """150 phones with 5 accounts each, wakeups queued account by account (so one phone's
    rows lie 150 apart, across the 500-row batch): still exactly one push per phone."""
    harness = await make_harness(limits={"coalesce_window_ms": 5000}, start=False)
    tokens = [apns_token() for _ in range(150)]
    accounts = [[SecretKey.generate().public_key_hex for _ in range(5)] for _ in tokens]
    devices = {
        (t, k): (await harness.devices.register(pubkey, "ios", token, "opaque", (), None, 0)).device
        for t, token in enumerate(tokens)
        for k, pubkey in enumerate(accounts[t])
    }
    for k in range(5):
        for t in range(len(tokens)):
            event = sign_event(harness.sender_key, 4, f"dm {t}/{k}", [["p", accounts[t][k]]])
            await harness.outbox.enqueue(event, RELAY, now_ms(), [devices[t, k]])
    await harness.start()

    # every row delivered (not 750 records: a send the loaded machine's connection dropped
    # is recorded, then retried), so a split phone's second push would have arrived by now
    await eventually(harness.drained, timeout=60.0, what="every wakeup delivered")
    wanted = set(tokens)
    assert len([r for r in fake_apns.requests if r.token in wanted]) == len(tokens)


async def test_a_dead_token_is_forgotten_even_if_the_push_named_a_signed_out_account(
    make_harness, fake_apns: FakeApns
) -> None:
    """The push for two accounts goes out under the first account's registration; that
    account signs out while APNs thinks. APNs then says 410: the other account's pair on the
    dead token is forgotten all the same."""
    harness = await make_harness(start=False)
    token = apns_token()
    first, second = SecretKey.generate().public_key_hex, SecretKey.generate().public_key_hex
    for pubkey in (first, second):
        device = (await harness.devices.register(pubkey, "ios", token, "opaque", (), None, 0)).device
        event = sign_event(harness.sender_key, 4, "hello", [["p", pubkey]])
        await harness.enqueue([device], event)
    fake_apns.script.answers[token] = (410, "Unregistered")
    fake_apns.script.delay_seconds = 1.0  # under the harness send timeout (3 s, scaled)
    await harness.start()

    await eventually(lambda: _apns_to(fake_apns, token), what="the push in flight")
    assert await harness.devices.unregister(first, token) == 1
    await eventually(harness.forgotten, what="the second account's pair forgotten")
    assert len(_apns_to(fake_apns, token)) == 1


# -- migrations ------------------------------------------------------------------------------


def _database_at_0004(path: Path) -> None:
    """A database as the previous release left it: migrations 0001-0004 and some rows,
    including a claimed wakeup (in flight at the last stop)."""
    connection = sqlite_at(path, 4)
    try:
        connection.executemany(
            "INSERT INTO devices (id, pubkey, platform, token, payload, relays, webpush_p256dh,"
            " webpush_auth, registered_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (3, "a" * 64, "ios", "ab" * 32, "event_id", '["wss://inbox.example"]', None, None,
                 1_700_000_000, 1_700_000_100),
                (8, "b" * 64, "unifiedpush", "https://push.example/x", "opaque", "[]", "p256",
                 "auth", 1_700_000_200, 1_700_000_200),
            ],
        )
        connection.executemany(
            "INSERT INTO outbox (id, device_id, event_id, relay, event_json, first_seen_ms,"
            " attempts, next_attempt_ms, claimed_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(5, 3, "e" * 64, RELAY, None, 1, 2, 3, 4), (6, 8, "f" * 64, RELAY, "{}", 5, 0, 6, None)],
        )
    finally:
        connection.close()


def _rows(path: Path, table: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as connection:
        return [tuple(r) for r in connection.execute(f"SELECT * FROM {table} ORDER BY id")]


async def test_migrating_a_0004_database_keeps_every_row_and_id(tmp_path: Path) -> None:
    """0005 rebuilds `devices` with foreign keys on (as `serve` opens it): every device and
    every queued wakeup survives with its id, the outbox still cascades, and a second npub can
    then register an existing token."""
    path = tmp_path / "old.db"
    _database_at_0004(path)
    devices_before, outbox_before = _rows(path, "devices"), _rows(path, "outbox")

    db = await open_database(path)
    try:
        assert await db.execute_fetchall("PRAGMA foreign_key_check") == []
        [(fk_on,)] = await db.execute_fetchall("PRAGMA foreign_keys")
        assert fk_on == 1
        devices = Devices(db)
        second = await devices.register("c" * 64, "ios", "ab" * 32, "opaque", (), None, 0)
        assert second.created and second.device.id not in (3, 8)
        [old] = await devices.of_pubkey("a" * 64)
        assert (old.id, old.payload, old.relays) == (3, "event_id", ("wss://inbox.example",))
        outbox = Outbox(db)
        due = await outbox.due(10, 10)
        assert [(w.id, w.device_id) for w in due] == [(6, 8)], "the claimed row stays claimed"
        await outbox.hold([6], 6)  # `due` reserved it: given back as it was, attempt undone
    finally:
        await db.close()
    # later migrations add columns (0008: device_key, NULL for every existing row; 0009: the
    # preferences, at their defaults: NULL, senders 'anyone', muted_count 0; 0017: notify 1,
    # `["dm"]`, and no quiet hours)
    width = len(devices_before[0])
    after = _rows(path, "devices")[:2]
    assert [row[:width] for row in after] == devices_before
    assert all(value in (None, 0, 1, "anyone") for row in after for value in row[width:])
    # 0015 moved the event JSON (column 4) into outbox_events, flagged by has_event (last)
    assert _rows(path, "outbox") == [
        (*row[:4], *row[5:], int(row[4] is not None)) for row in outbox_before
    ]
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT * FROM outbox_events").fetchall() == [(6, "{}")]
        connection.execute("PRAGMA foreign_keys = ON")
        connection.execute("DELETE FROM devices WHERE id = 8")
        assert [r[0] for r in connection.execute("SELECT id FROM outbox")] == [5]
        assert connection.execute("SELECT * FROM outbox_events").fetchall() == []
        versions = [r[0] for r in connection.execute("SELECT version FROM schema_migrations")]
        assert 5 in versions


async def test_the_postgres_schema_takes_pairs_too(postgres_url: str) -> None:
    """The PostgreSQL migration makes the same change: rows from before keep their ids, two
    npubs may hold one token, one npub may not hold it twice."""
    migrations = available()
    before = [m for m in migrations if m.version < 3]
    connection = await asyncpg.connect(postgres_url)
    try:
        await migrate_connection(connection, before)
        await connection.execute(
            "INSERT INTO devices (id, pubkey, platform, token, registered_at, updated_at)"
            " VALUES (41, $1, 'ios', $2, 1, 1)", "a" * 64, "ab" * 32,
        )
        await connection.execute(
            "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
            " VALUES (41, $1, 'wss://r', 1, 1)", "e" * 64,
        )
        applied = await migrate_connection(connection)
        assert applied == [m.name for m in migrations if m.version >= 3]
        await connection.execute(
            "INSERT INTO devices (pubkey, platform, token, registered_at, updated_at)"
            " VALUES ($1, 'ios', $2, 2, 2)", "b" * 64, "ab" * 32,
        )
        with pytest.raises(asyncpg.UniqueViolationError):
            await connection.execute(
                "INSERT INTO devices (pubkey, platform, token, registered_at, updated_at)"
                " VALUES ($1, 'ios', $2, 3, 3)", "b" * 64, "ab" * 32,
            )
        rows = await connection.fetch("SELECT id, pubkey FROM devices ORDER BY pubkey")
        assert [r["pubkey"] for r in rows] == ["a" * 64, "b" * 64] and rows[0]["id"] == 41
        [(device_id,)] = await connection.fetch("SELECT device_id FROM outbox")
        assert device_id == 41
    finally:
        await connection.close()


# -- configuration ---------------------------------------------------------------------------


def test_accounts_per_device_is_validated(tmp_path: Path) -> None:
    assert parse_config({}, tmp_path / "relays.toml").limits.accounts_per_device == 20
    assert parse_config(
        {"limits": {"accounts_per_device": 0}}, tmp_path / "relays.toml"
    ).limits.accounts_per_device == 0
    for bad in (-1, "5", 2.5, True):
        with pytest.raises(ConfigError) as refused:
            parse_config({"limits": {"accounts_per_device": bad}}, tmp_path / "relays.toml")
        assert refused.value.key == "limits.accounts_per_device"

