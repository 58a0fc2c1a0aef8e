"""Two workers' committers that overlap on events during a shard hand-over, on a real
PostgreSQL server: each writes a batch's rows in one lock order (by event id), so the later
one waits for the earlier one instead of PostgreSQL aborting one of them as a deadlock.

Each worker handles the same events, arrived in opposite orders. The interleaving is forced by
lock state, not by time: two held rows (a third and fourth connection's uncommitted inserts of
the same keys) stop each transaction after its first row; once both wait, they are let go.
The same moves in arrival order, as the committer wrote before, deadlock: that half shows the
choreography can fail.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import asyncpg
import pytest

from sigil_push.bridge.committer import Committer
from sigil_push.bridge.pending import Arrival
from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.migrate import migrate
from sigil_push.store.postgres.outbox import PostgresOutbox
from sigil_push.store.records import Device
from sigil_push.store.seen import SeenEvents
from tests.support.in_process import in_process_bridge

RELAY = "ws://127.0.0.1:9"
TABLES = ("outbox", "seen_events", "seen_on_relay")

Rows = tuple[
    list[tuple[Arrival, list[Device]]],
    list[tuple[str, tuple[str, ...], int, int]],
    list[tuple[str, str, int]],
]
"""What `Committer._write` takes: wakeups, new events, further relays' deliveries."""


def _rows(table: str, events: list[Event], device: Device) -> Rows:
    """A batch's rows in `table` only, for `events` in their arrival order."""
    if table == "outbox":
        return [(Arrival(e, RELAY, e.created_at * 1000, (device.pubkey,)), [device])
                for e in events], [], []
    if table == "seen_events":
        return [], [(e.id, (RELAY,), e.created_at * 1000, e.created_at) for e in events], []
    return [], [], [(e.id, RELAY, e.created_at) for e in events]


async def _hold(url: str, table: str, event: Event, device: Device) -> asyncpg.Connection:
    """A connection whose open transaction has inserted the row `event` makes in `table`."""
    connection = await asyncpg.connect(url)
    await connection.execute("BEGIN")
    if table == "outbox":
        await connection.execute(
            "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
            " VALUES ($1, $2, $3, 0, 0)", device.id, event.id, RELAY)
    else:
        await connection.execute(
            f"INSERT INTO {table} (event_id, relay, keep_until) VALUES ($1, $2, 1)",
            event.id, RELAY)
    return connection


async def _waiting_on_locks(watcher: asyncpg.Connection) -> int:
    return int(await watcher.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock'"))


async def _race(
    url: str, table: str, device: Device, held: tuple[Event, Event],
    writers: tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]],
) -> list[BaseException | None]:
    """Hold the rows of `held`, start both writers, wait until both wait on a lock, let the
    held rows go (roll back), and return each writer's error."""
    watcher = await asyncpg.connect(url)
    holders = [await _hold(url, table, event, device) for event in held]
    try:
        tasks = [asyncio.create_task(write()) for write in writers]
        deadline = asyncio.get_running_loop().time() + 60
        while await _waiting_on_locks(watcher) < 2:
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks]
            assert asyncio.get_running_loop().time() < deadline, "the writers never waited"
            await asyncio.sleep(0.01)
        for holder in holders:
            await holder.execute("ROLLBACK")
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]
    finally:
        for connection in [*holders, watcher]:
            await connection.close()


async def _arrival_order_writer(url: str, worker: str, rows: Rows) -> Callable[[], Awaitable[None]]:
    """The committer's transaction as it was: the same stores' writes, in arrival order."""
    db = PostgresDatabase(await asyncpg.connect(url))
    outbox, seen = PostgresOutbox(db, worker), SeenEvents(db, 3600, 10)
    writes, new_events, further = rows

    async def write() -> None:
        try:
            await db.execute("BEGIN")
            try:
                await outbox.enqueue_many(
                    [(a.event, a.relay, a.received_ms, targets) for a, targets in writes])
                await seen.save(new_events, further)
                await db.execute("COMMIT")
            except BaseException:
                await db.execute("ROLLBACK")
                raise
        finally:
            await db.close()

    return write


@pytest.mark.parametrize("table", TABLES)
async def test_overlapping_committers_wait_instead_of_deadlocking(
    postgres_url: str, tmp_path: Path, table: str
) -> None:
    """Workers A and B both handle events x, y (B got y first), each with one more event of
    its own held by another transaction right after its first row. In arrival order A holds
    x and B holds y, then each wants the other's: PostgreSQL aborts one (its batch retried,
    its wakeups at risk). Through the committer both commit, and every row is there once."""
    await migrate(postgres_url)
    key, sender = SecretKey.generate(), SecretKey.generate()
    x, p, q, y = (sign_event(sender, 4, secrets.token_hex(8), [("p", key.public_key_hex)],
                             1_700_000_000 + i) for i in range(4))
    a_events, b_events = [x, p, y], [y, q, x]

    async with AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(
            in_process_bridge(tmp_path / name, postgres_url)) for name in ("a", "b")]
        await workers[0].devices.register(
            key.public_key_hex, "android", "token-" + "a" * 20, "minimal", [], None, 10)
        (device,) = await workers[0].devices.of_pubkeys([key.public_key_hex])

        as_queued = await _race(postgres_url, table, device, (p, q), (
            await _arrival_order_writer(postgres_url, "a", _rows(table, a_events, device)),
            await _arrival_order_writer(postgres_url, "b", _rows(table, b_events, device)),
        ))
        assert any(isinstance(e, asyncpg.DeadlockDetectedError) for e in as_queued), as_queued
        connection = await asyncpg.connect(postgres_url)
        stack.push_async_callback(connection.close)
        await connection.execute(f"DELETE FROM {table}")

        committers: list[Committer] = [w.bridge._committer for w in workers]
        ordered = await _race(postgres_url, table, device, (p, q), (
            lambda: committers[0]._write(*_rows(table, a_events, device), []),
            lambda: committers[1]._write(*_rows(table, b_events, device), []),
        ))
        assert ordered == [None, None]
        rows = await connection.fetch(f"SELECT event_id FROM {table}")
        assert sorted(r[0] for r in rows) == sorted(e.id for e in (x, p, q, y))

