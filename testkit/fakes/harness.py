"""In-process delivery against the fakes: a real outbox and device store (a SQLite file or a
PostgreSQL database: `make_harness` runs every test that takes it on both), real signed
events, the real Delivery loop and the real provider clients, talking to the fake providers
over sockets.

The fixtures are registered for the whole suite by tests/conftest.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sigil_push.config import Config, parse_config
from sigil_push.delivery import Delivery
from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.push.factory import build_senders
from sigil_push.push.registry import TABLES
from sigil_push.store.factory import PostgresStore, SqliteStore
from sigil_push.store.interface import DeviceStore, OutboxStore
from sigil_push.store.records import Device, WebPushKeys
from testkit import deadlines
from testkit.deadlines import CONDITION_SECONDS, scaled
from testkit.fakes.credentials import (
    KEY_ID,
    TEAM_ID,
    TOPIC,
    TlsFiles,
    make_apns_key,
    make_service_account,
    make_tls,
)
from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.fake_fcm import FakeFcm
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush
from testkit.observations import observation_records
from testkit.relay import RelayProcess
from testkit.stores import Engine, PortableSql, open_test_store, sql_of

RELAY = "wss://relay.example.com"
VAPID_SUBJECT = "mailto:ops@example.org"


@dataclass(frozen=True)
class Credentials:
    folder: Path
    tls: TlsFiles
    apns_key: Path
    apns_public_key: bytes


@pytest.fixture(scope="session")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    folder = tmp_path_factory.mktemp("push-credentials")
    apns_key, apns_public = make_apns_key(folder)
    return Credentials(folder, make_tls(folder), apns_key, apns_public)


@pytest.fixture(scope="session", autouse=True)
def trust_the_test_ca(credentials: Credentials) -> Iterator[None]:
    """Every TLS client of the session (and the processes it starts) trusts only the fakes' CA,
    through SSL_CERT_FILE, which OpenSSL and httpx read: tests reach no other TLS server, and a
    context loading one certificate costs a millisecond where the system or certifi bundle
    costs tenths of a second under load, paid several times by every FCM and APNs sender."""
    previous = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(credentials.tls.ca_file)
    yield
    if previous is None:
        os.environ.pop("SSL_CERT_FILE", None)
    else:
        os.environ["SSL_CERT_FILE"] = previous


@pytest.fixture(scope="session")
def fake_apns(credentials: Credentials) -> Iterator[FakeApns]:
    fake = FakeApns(credentials.tls.cert_file, credentials.tls.key_file, credentials.apns_public_key)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def fake_fcm_server(credentials: Credentials) -> Iterator[tuple[FakeFcm, Path]]:
    fake = FakeFcm(None).start()
    account, public = make_service_account(credentials.folder, fake.token_uri)
    fake.public_key = public
    yield fake, account
    fake.stop()


@pytest.fixture
def fake_fcm(fake_fcm_server: tuple[FakeFcm, Path]) -> FakeFcm:
    return fake_fcm_server[0]


@pytest.fixture(scope="session")
def fake_up() -> Iterator[FakeUnifiedPush]:
    fake = FakeUnifiedPush().start()
    yield fake
    fake.stop()


def provider_tables(credentials: Credentials, apns: FakeApns, fcm: tuple[FakeFcm, Path]) -> dict[str, Any]:
    """The `[apns]`, `[fcm]` and `[unifiedpush]` tables pointing at the fakes."""
    return {
        "apns": {
            "team_id": TEAM_ID, "key_id": KEY_ID, "key_file": str(credentials.apns_key),
            "topic": TOPIC, "environment": "sandbox", "endpoint": apns.endpoint,
            "ca_file": str(credentials.tls.ca_file),
        },
        "fcm": {"credentials_file": str(fcm[1]), "endpoint": fcm[0].url},
        "unifiedpush": {"allow_private_endpoints": True, "vapid_subject": VAPID_SUBJECT},
    }


def toml_tables(tables: dict[str, Any]) -> str:
    """Render `provider_tables` as TOML for a `sigil-push serve` process."""
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in table.items())
    return "\n".join(lines) + "\n"


class Harness:
    """The delivery pipeline of one service, minus the relay bridge that normally fills it."""

    store: SqliteStore | PostgresStore
    db: PortableSql
    devices: DeviceStore
    outbox: OutboxStore

    def __init__(self, folder: Path, document: dict[str, Any], database: str) -> None:
        """`database`: the store, a SQLite file's path or a PostgreSQL URL."""
        self.folder = folder
        self.document = document
        self.database = database
        self.sender_key = SecretKey.generate()
        self.recipient_key = SecretKey.generate()
        self.config: Config = parse_config(document, folder / "relays.toml", TABLES)
        self.delivery: Delivery | None = None

    async def open(self) -> None:
        self.store = await open_test_store(self.database)
        self.db = sql_of(self.store)
        self.devices, self.outbox = self.store.devices, self.store.outbox
        self.observations = ObservationLog(self.folder / "observations")
        await self.observations.start()

    async def start(self) -> None:
        senders = await build_senders(self.config)
        self.delivery = Delivery(
            self.outbox, self.devices, senders, self.observations, not self.config.dry_run,
            self.config.push, self.config.limits,
        )
        await self.delivery.start()

    async def stop_delivery(self) -> None:
        if self.delivery is not None:
            await self.delivery.stop()
            self.delivery = None

    async def close(self) -> None:
        await self.stop_delivery()
        await self.observations.stop()
        await self.store.close()

    async def register(
        self, platform: str, token: str, payload: str = "opaque", keys: WebPushKeys | None = None
    ) -> Device:
        registration = await self.devices.register(
            self.recipient_key.public_key_hex, platform, token, payload, (), keys, 0
        )
        return registration.device

    def event(self, content: str = "", kind: int = 4) -> Event:
        """A signed DM to the recipient; distinct every call (same-second events would share an id)."""
        content = content or f"secret message text {os.urandom(8).hex()}"
        return sign_event(
            self.sender_key, kind, content, [["p", self.recipient_key.public_key_hex]]
        )

    async def enqueue(
        self, devices: Sequence[Device], event: Event | None = None, first_seen_ms: int | None = None
    ) -> Event:
        event = event or self.event()
        await self.outbox.enqueue(event, RELAY, first_seen_ms or now_ms(), devices)
        return event

    async def pending(self) -> int:
        return await self.outbox.depth()

    async def drained(self) -> bool:
        return await self.outbox.depth() == 0

    async def forgotten(self) -> bool:
        return await self.devices.count() == 0

    async def outbox_rows(self) -> list[tuple[Any, ...]]:
        return await self.db.execute_fetchall(
            "SELECT id, device_id, event_id, attempts, next_attempt_ms, claimed_ms FROM outbox"
        )

    def push_records(self) -> list[dict[str, Any]]:
        records = observation_records(self.folder / "observations")
        return [record for record in records if record["type"] == "push"]


async def eventually(
    check: Callable[[], Any], timeout: float = CONDITION_SECONDS, what: str = "condition"
) -> Any:
    """Poll `check` (sync or async) until it returns something truthy; `timeout` is scaled by
    the suite's deadline policy (testkit.deadlines)."""
    return await deadlines.eventually(check, what, timeout)


def document(
    providers: dict[str, Any], push: dict[str, Any] | None = None, limits: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A config document with test-friendly delivery tuning (fast retries, small windows). The
    send timeout is how long a sender waits for a fake provider's answer: a deadline, so it
    scales (testkit.deadlines); a fixed 3 s timed sends out on a loaded machine and their
    retries reached the fake twice."""
    return {
        **providers,
        "push": {"retry_base_seconds": 0.05, "retry_max_seconds": 0.2,
                 "send_timeout_seconds": scaled(3.0),
                 **(push or {})},
        "limits": {"coalesce_window_ms": 0, "wakeups_per_minute_per_device": 0, **(limits or {})},
    }


@pytest.fixture
def apns_relay_config(
    tmp_path: Path, engine: Engine, module_relay: RelayProcess, credentials: Credentials,
    fake_apns: FakeApns, fake_fcm_server: tuple[FakeFcm, Path],
) -> dict[str, Any]:
    """The config of the in-process stories: a whole service on the test's engine and the
    module's relay, sending to the APNs fake, without API rate limits."""
    fake_apns.script.answers.clear()
    config = document(
        {"apns": provider_tables(credentials, fake_apns, fake_fcm_server)["apns"]},
        limits={"requests_per_minute_per_ip": 0, "requests_per_minute_per_npub": 0},
    )
    config["server"] = {
        "database": engine.database(str(tmp_path / "sigil-push.db")),
        "public_url": "http://127.0.0.1:8080", "allow_insecure_relays": True,
    }
    config["relay"] = [{"url": module_relay.url}]
    return config


def reset_fakes(fake_apns: FakeApns, fake_fcm: FakeFcm, fake_up: FakeUnifiedPush) -> None:
    """The session-wide fakes as new: no scripted answers left from an earlier test, and no
    UnifiedPush requests under endpoint names (e.g. "big") an earlier test also used."""
    fake_apns.script.answers.clear()
    fake_apns.script.delay_seconds, fake_apns.script.silent = 0.0, False
    fake_fcm.script.answers.clear()
    fake_up.script.answers.clear()
    fake_up.script.redirects.clear()
    fake_up.requests.clear()


@pytest.fixture
async def make_harness(
    tmp_path: Path,
    credentials: Credentials,
    fake_apns: FakeApns,
    fake_fcm_server: tuple[FakeFcm, Path],
    fake_up: FakeUnifiedPush,
    engine: Engine,
) -> AsyncIterator[Callable[..., Any]]:
    """Factory: `await make_harness(push={...}, limits={...})` gives a started Harness with
    fresh fakes, a folder and a store of its own, on the parametrised engine (so a test taking
    it runs on SQLite and on PostgreSQL); every harness is closed after the test."""
    harnesses: list[Harness] = []
    reset_fakes(fake_apns, fake_fcm_server[0], fake_up)

    async def make(
        push: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
        providers: dict[str, Any] | None = None,
        start: bool = True,
    ) -> Harness:
        tables = provider_tables(credentials, fake_apns, fake_fcm_server) if providers is None else providers
        folder = tmp_path / f"service-{len(harnesses)}"
        folder.mkdir()
        database = engine.database(str(folder / "sigil-push.db"))
        harness = Harness(folder, document(tables, push, limits), database)
        await harness.open()
        harnesses.append(harness)
        if start:
            await harness.start()
        return harness

    try:
        yield make
    finally:
        for harness in harnesses:
            await harness.close()


def apns_token() -> str:
    return os.urandom(32).hex()


def fcm_token() -> str:
    return "fcm-" + os.urandom(24).hex()
