"""One in-process Bridge over a real store, for tests that feed it relay input directly (no
relay process, no service): the set-up and tear-down those tests share.

The store is opened as `serve` opens it (`open_store` on the config's `server.database`), so
on PostgreSQL the bridge runs on the real PostgreSQL parts: its committer's own connection,
PostgresOutbox, PostgresDevices announcing registrations with NOTIFY, seen ids on the
PostgreSQL handle. One worker watches every key, as `serve` does on SQLite: key shards and
their leases are the multi-worker tests' subject (tests/stories/test_pg_workers.py,
tests/store/test_pg_leases.py), not these. The Bridge is wired as the service wires it (the devices
notify it of registrations, the Iris store of subscriptions) and started; on exit it is stopped before the observation log and
the store close.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sigil_push.bridge import Bridge
from sigil_push.config import parse_config
from sigil_push.http.api import create_app
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog
from sigil_push.push.registry import TABLES
from sigil_push.service import Service
from sigil_push.store.factory import open_store
from sigil_push.store.interface import DeviceStore, OutboxStore, Store
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nip98 import SdkUser
from testkit.observations import observation_records
from testkit.stores import PortableSql, sql_of


@dataclass
class InProcessBridge:
    """The parts a test reaches into: the store (and its halves), the log, the bridge."""

    store: Store
    observations: ObservationLog
    bridge: Bridge

    @property
    def db(self) -> PortableSql:
        """The test's own portable `?` SQL on the store's connection."""
        return sql_of(self.store)

    @property
    def devices(self) -> DeviceStore:
        return self.store.devices

    @property
    def outbox(self) -> OutboxStore:
        return self.store.outbox


@asynccontextmanager
async def in_process_bridge(
    folder: Path,
    database: str,
    relays: list[dict[str, Any]] | None = None,
    bridge: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
) -> AsyncIterator[InProcessBridge]:
    """A started `Bridge` on the store `database` names (a SQLite file, relative to
    `folder`, or a PostgreSQL URL: testkit.stores.Engine.database), its observation log
    in `folder`; `relays` are the config's `[[relay]]` tables (none: only users' own relays),
    `bridge` its `[bridge]` table, `server` more `[server]` keys (e.g. `allow_insecure_relays`
    for users' loopback relays)."""
    document: dict[str, Any] = {"server": {"database": database, **(server or {})}}
    if relays:
        document["relay"] = relays
    if bridge:
        document["bridge"] = bridge
    config = parse_config(document, folder / "relays.toml", TABLES)
    async with AsyncExitStack() as stack:
        store = await open_store(config)
        stack.push_async_callback(store.close)
        observations = ObservationLog(folder / "observations")
        await observations.start()
        stack.push_async_callback(observations.stop)
        running = await Bridge.create(
            config, store.devices, store.outbox, observations, SecretKey.generate(),
            iris=store.iris,
        )
        stack.push_async_callback(running.close)
        store.devices.add_listener(running.registration_changed)
        store.iris.add_listener(running.iris_changed)
        store.devices.add_rules_listener(running.rules_changed)
        await running.start()
        stack.push_async_callback(running.stop)
        yield InProcessBridge(store, observations, running)


@dataclass
class InProcessService:
    """A whole `Service` (API, bridge, delivery to the configured providers) in the test's own
    event loop, with an HTTP client that reaches its API without a socket."""

    service: Service
    http: httpx.AsyncClient
    public_url: str
    folder: Path

    async def call(self, user: SdkUser, method: str, path: str, body: Any = None) -> httpx.Response:
        """A NIP-98-authenticated request by `user`, signed by nostr-sdk (a random nonce tag
        keeps two identical requests in one second from being one replayed auth event)."""
        raw = b"" if body is None else json.dumps(body).encode()
        header = user.header(self.public_url + path, method, raw,
                             extra_tags=[["nonce", secrets.token_hex(8)]])
        headers = {"authorization": header}
        if raw:
            headers["content-type"] = "application/json"
        return await self.http.request(method, path, content=raw, headers=headers)

    def observation_records(self) -> list[dict[str, Any]]:
        return observation_records(self.folder / "observations")


@asynccontextmanager
async def in_process_service(folder: Path, document: dict[str, Any]) -> AsyncIterator[InProcessService]:
    """`Service` started on the config `document` (its `server.public_url` is the base URL the
    NIP-98 `u` tags name); stopped on exit."""
    config = parse_config(document, folder / "relays.toml", TABLES)
    service = Service(config)
    await service.start()
    try:
        transport = httpx.ASGITransport(app=create_app(service))
        public_url = config.server.public_url
        async with httpx.AsyncClient(transport=transport, base_url=public_url, timeout=scaled(REQUEST_SECONDS)) as http:
            yield InProcessService(service, http, public_url, folder)
    finally:
        await service.stop()
