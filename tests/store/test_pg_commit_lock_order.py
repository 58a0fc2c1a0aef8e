"""Two workers that overlap on events and keys during a shard hand-over, on a real PostgreSQL
server: each writes a batch's rows in one lock order (by event id; relay lists by key, relay
cursors by relay), so the later one waits for the earlier one instead of PostgreSQL aborting
one of them as a deadlock.

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
from sigil_push.nostr.kinds import DM_RELAYS
from sigil_push.relays.discovery import RelayLists
from sigil_push.store.postgres.bridge_state import PostgresRelayState, PostgresSeenRows
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.migrate import migrate
from sigil_push.store.postgres.outbox import PostgresOutbox
from sigil_push.store.records import Device
from sigil_push.store.seen import SeenEvents
from testkit.deadlines import scaled
from testkit.in_process import in_process_bridge

RELAY = "ws://127.0.0.1:9"
TABLES = ("outbox", "seen_events", "further")
"""Where the rows go; `further`: relays appended to `seen_events` rows already there."""

Rows = tuple[
    list[tuple[Arrival, list[Device]]],
    list[tuple[str, tuple[str, ...], int, int]],
    list[tuple[str, str]],
]
"""What `Committer._write` takes: wakeups, new events, further relays' deliveries."""


def _rows(table: str, events: list[Event], device: Device) -> Rows:
    """A batch's rows in `table` only, for `events` in their arrival order."""
    if table == "outbox":
        return [(Arrival(e, RELAY, e.created_at * 1000, (device.pubkey,)), [device])
                for e in events], [], []
    if table == "seen_events":
        return [], [(e.id, (RELAY,), e.created_at * 1000, e.created_at) for e in events], []
    return [], [], [(e.id, RELAY) for e in events]


Hold = tuple[str, tuple[object, ...]]
"""A write a holding connection runs and leaves uncommitted: it holds that row's key (an
INSERT) or the row itself (an UPDATE)."""
FIRST = "wss://first.example"
"""The relay of the committed `seen_events` rows that further relays are appended to."""


def _held_rows(table: str, events: tuple[Event, ...], device: Device) -> list[Hold]:
    """The rows `events` make in `table`, as another transaction's uncommitted inserts."""
    if table == "outbox":
        sql = ("INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
               " VALUES ($1, $2, $3, 0, 0)")
        return [(sql, (device.id, e.id, RELAY)) for e in events]
    if table == "further":
        return [("UPDATE seen_events SET relay = relay WHERE event_id = $1",
                 (bytes.fromhex(e.id),)) for e in events]
    return [(f"INSERT INTO {table} (event_id, relay, keep_until) VALUES ($1, $2, 1)",
             (bytes.fromhex(e.id), RELAY)) for e in events]


async def _waiting_on_locks(watcher: asyncpg.Connection) -> int:
    return int(await watcher.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock'"))


async def _race(
    url: str, holds: list[Hold],
    writers: tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]],
) -> list[BaseException | None]:
    """Hold the rows of `holds` (one transaction each), start both writers, wait until both
    wait on a lock, let the held rows go (roll back), and return each writer's error."""
    watcher = await asyncpg.connect(url)
    holders = [await asyncpg.connect(url) for _ in holds]
    try:
        for holder, (sql, args) in zip(holders, holds, strict=True):
            await holder.execute("BEGIN")
            await holder.execute(sql, *args)
        tasks = [asyncio.create_task(write()) for write in writers]
        deadline = asyncio.get_running_loop().time() + scaled(60)
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
    outbox, seen = PostgresOutbox(db, worker), SeenEvents(PostgresSeenRows(db), 3600, 10)
    writes, new_events, further = rows

    async def write() -> None:
        try:
            async with db.transaction():
                await outbox.enqueue_many(
                    [(a.event, a.relay, a.received_ms, targets) for a, targets in writes])
                await seen.save(new_events, further)
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

        connection = await asyncpg.connect(postgres_url)
        stack.push_async_callback(connection.close)

        async def fresh() -> None:
            """The table as each race finds it: empty, or with the events' first rows."""
            await connection.execute(
                f"DELETE FROM {'seen_events' if table == 'further' else table}")
            if table == "further":
                await connection.executemany(
                    "INSERT INTO seen_events (event_id, relay, keep_until) VALUES ($1, $2, 1)",
                    [(bytes.fromhex(e.id), FIRST) for e in (x, p, q, y)])

        await fresh()
        held = _held_rows(table, (p, q), device)
        as_queued = await _race(postgres_url, held, (
            await _arrival_order_writer(postgres_url, "a", _rows(table, a_events, device)),
            await _arrival_order_writer(postgres_url, "b", _rows(table, b_events, device)),
        ))
        assert any(isinstance(e, asyncpg.DeadlockDetectedError) for e in as_queued), as_queued
        await fresh()

        committers: list[Committer] = [w.bridge._committer for w in workers]
        ordered = await _race(postgres_url, held, (
            lambda: committers[0]._write(*_rows(table, a_events, device), [], []),
            lambda: committers[1]._write(*_rows(table, b_events, device), [], []),
        ))
        assert ordered == [None, None]
        if table == "further":
            rows = await connection.fetch(
                "SELECT encode(event_id, 'hex'), relay FROM seen_events")
            appended = {e.id: FIRST for e in (x, p, q, y)}
            for event in [*a_events, *b_events]:
                appended[event.id] += " " + RELAY
            assert dict(rows) == appended, "each worker's relay appended once per event"
            return
        hex_id = "event_id" if table == "outbox" else "encode(event_id, 'hex')"
        rows = await connection.fetch(f"SELECT {hex_id} FROM {table}")
        assert sorted(r[0] for r in rows) == sorted(e.id for e in (x, p, q, y))



def _list_of(key: SecretKey, relay: str) -> Event:
    return sign_event(key, DM_RELAYS, "", [("relay", relay)], 1_700_000_000)


async def test_overlapping_workers_save_relay_lists_without_deadlock(postgres_url: str) -> None:
    """Workers A and B both take the DM relay lists of keys x and y (B got y's first), and one
    more each, held by another transaction. Saved in key order, B waits for A and both
    commit (in the order each took them, they deadlocked)."""
    await migrate(postgres_url)
    x, p, q, y = (SecretKey.generate() for _ in range(4))
    saves = []
    for worker, keys in (("a", [x, p, y]), ("b", [y, q, x])):
        db = PostgresDatabase(await asyncpg.connect(postgres_url))
        lists = RelayLists(PostgresRelayState(db), allow_insecure=False)
        for key in keys:
            lists.offer(_list_of(key, f"wss://{worker}.example"))
        saves.append((db, lists))

    async def save(index: int) -> None:
        db, lists = saves[index]
        try:
            await lists.save()
        finally:
            await db.close()

    sql = "INSERT INTO relay_lists (pubkey, kind, created_at, relays) VALUES ($1, $2, 1, '[]')"
    held: list[Hold] = [(sql, (k.public_key_hex, DM_RELAYS)) for k in (p, q)]
    assert await _race(postgres_url, held, (lambda: save(0), lambda: save(1))) == [None, None]
    connection = await asyncpg.connect(postgres_url)
    try:
        rows = await connection.fetch("SELECT pubkey FROM relay_lists")
    finally:
        await connection.close()
    assert sorted(r[0] for r in rows) == sorted(k.public_key_hex for k in (x, p, q, y))


async def test_overlapping_workers_save_relay_cursors_without_deadlock(
    postgres_url: str, tmp_path: Path
) -> None:
    """Every worker saves the cursor of every relay it reads; A connected relays x then y, B
    y then x, and each has one more relay whose row another transaction holds. Saved in relay
    order, both commit (in connection order, they deadlocked)."""
    await migrate(postgres_url)
    x, p, q, y = (f"wss://{name}.example" for name in "xpqy")
    async with AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(
            in_process_bridge(tmp_path / name, postgres_url)) for name in ("a", "b")]
        for worker, relays in zip(workers, ([x, p, y], [y, q, x]), strict=True):
            worker.bridge._pool.cursors.update((relay, 1_700_000_000) for relay in relays)
        held: list[Hold] = [("INSERT INTO relay_cursors (relay, live_until) VALUES ($1, 1)",
                             (relay,)) for relay in (p, q)]
        saved = await _race(postgres_url, held, (
            workers[0].bridge.save_cursors, workers[1].bridge.save_cursors))
        assert saved == [None, None]
        rows = await workers[0].db.execute_fetchall("SELECT relay FROM relay_cursors")
        assert sorted(r[0] for r in rows) == sorted((x, p, q, y))
