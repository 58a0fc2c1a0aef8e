"""The database refusing the committer's writes for a long time loses nothing: a real
`nostr-relay` process, a whole sigil-push `Service` in the test's event loop sending to the
fake APNs server, and a second connection that holds the database's write lock (SQLite: a raw
`BEGIN IMMEDIATE`; PostgreSQL: `LOCK TABLE seen_events IN EXCLUSIVE MODE`, which the
committer's transaction waits on after writing its outbox rows).

The committer's lock wait and backoff are lowered here, so the outage outlasts many more
attempts than the five after which a batch used to be given up ("their wakeups are lost")
without the test waiting the ~23 s that took.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import nostr_sdk
import pytest
from prometheus_client import REGISTRY

from sigil_push.bridge.pending import Arrival
from sigil_push.nostr.event import Event
from sigil_push.relays.labels import series_label
from testkit.deadlines import scaled
from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.harness import apns_token, eventually
from testkit.in_process import InProcessService, in_process_service
from testkit.nip98 import SdkUser
from testkit.nostr_client import kind4_dm, publish
from testkit.relay import RelayProcess
from testkit.stores import Engine, fetch, sql_of

DEADLINE = 60.0
OLD_COMMIT_ATTEMPTS = 5
"""After this many refused attempts the committer used to drop the batch."""


@pytest.fixture
def config(apns_relay_config: dict[str, Any]) -> dict[str, Any]:
    return apns_relay_config


def _retries() -> float:
    return REGISTRY.get_sample_value("sigil_push_bridge_commit_retries_total") or 0.0


class WriteLock:
    """Another connection holding the lock the committer's transaction needs."""

    def __init__(self, engine: Engine, database: str) -> None:
        self._engine, self._database = engine, database
        self._sqlite: sqlite3.Connection | None = None
        self._postgres: asyncpg.Connection | None = None

    async def take(self) -> None:
        if self._engine.postgres:
            self._postgres = await asyncpg.connect(self._database)
            await self._postgres.execute("BEGIN")
            await self._postgres.execute("LOCK TABLE seen_events IN EXCLUSIVE MODE")
        else:
            # the service may be writing (its registration, a batch): wait as long as the
            # stories' deadline for its write to end, not sqlite3's default 5 s (loaded runs
            # saw "database is locked" here), and wait in a thread: sqlite3's busy wait
            # blocks, and on the event loop it kept the in-process service from finishing
            # the very write it waited for
            self._sqlite = await asyncio.to_thread(self._begin_immediate)

    def _begin_immediate(self) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self._database, isolation_level=None, timeout=scaled(DEADLINE),
            check_same_thread=False,
        )
        connection.execute("BEGIN IMMEDIATE")
        return connection

    async def release(self) -> None:
        if self._postgres is not None:
            await self._postgres.close()  # its transaction ends with it
            self._postgres = None
        if self._sqlite is not None:
            self._sqlite.execute("ROLLBACK")
            self._sqlite.close()
            self._sqlite = None


@asynccontextmanager
async def _write_lock(engine: Engine, database: str) -> AsyncIterator[None]:
    lock = WriteLock(engine, database)
    await lock.take()
    try:
        yield
    finally:
        await lock.release()


async def _impatient(instance: InProcessService, engine: Engine) -> None:
    """The committer waits 50 ms per lock and at most 50 ms between attempts."""
    bridge = instance.service.components.bridge
    committer = bridge._committer
    committer.retry_first_seconds = 0.01
    committer.retry_max_seconds = 0.05
    link = bridge._link
    assert link is not None
    if engine.postgres:
        await sql_of(link).execute("SET lock_timeout = '50ms'")
    else:
        await sql_of(link).execute("PRAGMA busy_timeout=50")


async def _register(instance: InProcessService, relay: RelayProcess) -> tuple[SdkUser, str]:
    user, token = SdkUser(), apns_token()
    body = {"npub": user.npub, "platform": "ios", "device_token": token}
    assert (await instance.call(user, "POST", "/register", body)).status_code == 201

    def live() -> bool:
        state = instance.service.relay_health().get(relay.url)
        return bool(state and state.get("live") and state.get("keys") == 1)

    await eventually(live, DEADLINE, "the key live on the relay")
    return user, token


def _counted(relay: RelayProcess) -> tuple[float, float]:
    """The relay's repeats and the pre-registration events, as counted so far."""
    repeats = REGISTRY.get_sample_value(
        "sigil_push_bridge_events_duplicate_total", {"relay": series_label(relay.url)}
    )
    baselined = REGISTRY.get_sample_value("sigil_push_bridge_events_baselined_total")
    return repeats or 0.0, baselined or 0.0


def _pushes(fake_apns: FakeApns, token: str) -> int:
    return sum(1 for request in fake_apns.requests if request.token == token)


def _stored(database: str, event_id: str) -> bool:
    """Whether the event's `seen_events` row is on disk (both engines keep the id as bytes)."""
    key = bytes.fromhex(event_id)
    return bool(fetch(database, "SELECT relay FROM seen_events WHERE event_id = ?", [key]))


async def test_a_long_outage_delays_the_batch_and_shows_in_health_but_loses_nothing(
    tmp_path: Path, engine: Engine, module_relay: RelayProcess, fake_apns: FakeApns,
    config: dict[str, Any],
) -> None:
    """While the lock is held the DM's batch is retried far past the old five attempts, the
    retries are counted (the batch's repeats and pre-registration events once), /health answers 503 naming the committer and why; once the lock is
    released the DM is stored and pushed exactly once and /health is ok again."""
    database = config["server"]["database"]
    async with in_process_service(tmp_path, config) as instance:
        user, token = await _register(instance, module_relay)
        await _impatient(instance, engine)
        earlier = kind4_dm(nostr_sdk.Keys.generate(), user.keys, "before the outage")
        await publish(module_relay.url, earlier)
        await eventually(lambda: _pushes(fake_apns, token) == 1, DEADLINE, "the first DM pushed")
        counted = _counted(module_relay)
        before = _retries()
        dm = kind4_dm(nostr_sdk.Keys.generate(), user.keys, "during the outage")
        async with _write_lock(engine, database):
            # in the refused batch: a repeat of the earlier DM and an event that wakes nobody
            pending = instance.service.components.bridge._committer._pending
            received_ms = int(time.time() * 1000)
            pending.enqueue(Arrival(Event.from_json(earlier), module_relay.url, received_ms, ()))
            history = kind4_dm(nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate(), "old")
            pending.enqueue(Arrival(Event.from_json(history), module_relay.url, received_ms, ()))
            await publish(module_relay.url, dm)
            await eventually(lambda: _retries() - before > 3 * OLD_COMMIT_ATTEMPTS, DEADLINE,
                             "the batch retried far past the old give-up")
            # the deferred wakeups' claim writes no `seen_events` row: on PostgreSQL it goes
            # through beside the lock, and must not end the batch's outage in /health
            committer = instance.service.components.bridge._committer
            if engine.postgres:
                await committer.claim_deferred()
            else:
                with pytest.raises(sqlite3.OperationalError):
                    await committer.claim_deferred()
            health = await instance.http.get("/health")
            assert health.status_code == 503, health.text
            body = health.json()
            assert body["status"] == "degraded"
            assert "bridge-commit" in body["down"]
            assert "database unavailable" in body["reasons"]["bridge-commit"]
            assert _pushes(fake_apns, token) == 1
            assert not _stored(database, dm["id"])

        await eventually(lambda: _pushes(fake_apns, token) == 2, DEADLINE, "the DM pushed")
        assert _stored(database, dm["id"])
        # counted once, however many times the refused batch was decided again
        assert _counted(module_relay) == (counted[0] + 1, counted[1] + 1)

        async def healthy() -> bool:
            return (await instance.http.get("/health")).status_code == 200

        await eventually(healthy, DEADLINE, "/health ok again")
        retries = _retries()
        # a later DM goes through at once, and the outage's DM is never pushed again
        later = kind4_dm(nostr_sdk.Keys.generate(), user.keys, "after the outage")
        await publish(module_relay.url, later)
        await eventually(lambda: _pushes(fake_apns, token) == 3, DEADLINE, "the later DM pushed")
        assert _retries() == retries


async def test_a_stop_during_an_outage_ends_and_the_next_start_catches_the_dm_up(
    tmp_path: Path, engine: Engine, module_relay: RelayProcess, fake_apns: FakeApns,
    config: dict[str, Any],
) -> None:
    """Stopping while the committer retries ends within the stop grace (it does not wait for
    the database forever); the DM it could not store is not seen, so the next start's
    catch-up pushes it, once."""
    database = config["server"]["database"]
    lock = WriteLock(engine, database)
    try:
        async with asyncio.timeout(scaled(3 * DEADLINE)), in_process_service(tmp_path, config) as instance:
            user, token = await _register(instance, module_relay)
            await _impatient(instance, engine)
            instance.service.components.bridge._committer.stop_grace_seconds = 0.5
            before = _retries()
            await lock.take()
            dm = kind4_dm(nostr_sdk.Keys.generate(), user.keys, "before the stop")
            await publish(module_relay.url, dm)
            await eventually(lambda: _retries() - before > OLD_COMMIT_ATTEMPTS, DEADLINE,
                             "the batch being retried")
            stopping = time.monotonic()
        # the service's whole stop (relays, delivery, the store), not only the committer's
        assert time.monotonic() - stopping < scaled(DEADLINE)
        assert not _stored(database, dm["id"])
    finally:
        await lock.release()
    assert _pushes(fake_apns, token) == 0
    async with in_process_service(tmp_path, config):
        await eventually(lambda: _pushes(fake_apns, token) == 1, DEADLINE,
                         "the DM caught up and pushed")
        assert _stored(database, dm["id"])
    assert _pushes(fake_apns, token) == 1
