"""A hand-over of many keys on a real PostgreSQL server: applied in bounded chunks that let the
event loop run in between (lease heartbeats, the API and ingest share it), keys given away
released before the new ones load, only the arriving keys' baselines read; and baseline
writes of two workers that overlap on keys cannot deadlock.

The bridge is a real in-process one (testkit/in_process.py) whose firehose relay is a
closed loopback port: what is exercised is loading, planning and the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import asyncpg
import pytest

from sigil_push.bridge import Bridge
from sigil_push.bridge.pending import (
    DELETE_BASELINE,
    DELETE_BASELINES_OF,
    DELETE_RELAY_LISTS,
    INSERT_BASELINES,
    OP_ROWS_PER_COMMIT,
    DbOp,
    Pending,
    in_lock_order,
)
from sigil_push.bridge.relay_state import RelayState
from sigil_push.config import Config, parse_config
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog
from sigil_push.relays.discovery import RelayLists
from sigil_push.shards import DEFAULT_SHARDS, ShardSet, shard_of
from sigil_push.store.factory import open_store
from sigil_push.store.interface import RelayStateStore, Store
from sigil_push.store.postgres.migrate import migrate
from sigil_push.store.sqlite.bridge_state import BOOKKEEPING_SQL
from testkit.deadlines import scaled
from testkit.in_process import in_process_bridge
from testkit.stores import numbered

RELAY = "ws://127.0.0.1:9"  # nothing listens
KEYS = 30_000
CHUNK = 2_000


async def until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + scaled(timeout)
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _store(url: str, keys: list[str]) -> None:
    """Devices for `keys`, and a baseline of each on the relay (as another worker stored)."""
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(
            "INSERT INTO devices (pubkey, platform, token, registered_at, updated_at)"
            " SELECT k, 'android', 'token-' || k, 0, 0 FROM unnest($1::text[]) AS k",
            keys,
        )
        await connection.execute(
            "INSERT INTO relay_baselines (relay, pubkey, baselined_at)"
            " SELECT $2, k, 1 FROM unnest($1::text[]) AS k",
            keys, RELAY,
        )
    finally:
        await connection.close()


@contextlib.asynccontextmanager
async def _firehose_instance(
    url: str, folder: Path, keys: list[str]
) -> AsyncIterator[tuple[Config, Store, ObservationLog]]:
    """A migrated database holding `keys`, with the config of one firehose relay (nothing
    listens there), its opened store and a started observation log, closed on the way out."""
    await migrate(url)
    await _store(url, keys)
    config = parse_config(
        {"server": {"database": url}, "relay": [{"url": RELAY, "mode": "firehose"}]},
        folder / "relays.toml",
    )
    store = await open_store(config)
    observations = ObservationLog(folder / "observations")
    await observations.start()
    try:
        yield config, store, observations
    finally:
        await observations.stop()
        await store.close()


async def test_a_large_reshard_runs_in_chunks_the_loop_gets_between(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Giving away half the shards and taking them back, while a second coroutine counts its
    turns: between two of its turns the watched keys change by at most one chunk, and it gets
    turns in the middle of both the release and the load. Taking the shards back reads the
    baselines of their keys only, not every stored row."""
    monkeypatch.setattr("sigil_push.bridge.keys.RESHARD_CHUNK", CHUNK)
    await migrate(postgres_url)
    keys = [secrets.token_hex(32) for _ in range(KEYS)]
    await _store(postgres_url, keys)
    half = frozenset(range(DEFAULT_SHARDS // 2))
    every = frozenset(range(DEFAULT_SHARDS))
    given = {k for k in keys if shard_of(k) not in half}

    async with in_process_bridge(tmp_path, postgres_url, [{"url": RELAY, "mode": "firehose"}]) as parts:
        bridge = parts.bridge
        registry = bridge._registry
        assert len(registry.keys) == KEYS
        seen: list[int] = []
        done = asyncio.Event()

        async def other_coroutine() -> None:
            """What the heartbeat is to the loop: a task that wants a turn now and then."""
            while not done.is_set():
                seen.append(len(registry.keys))
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other_coroutine())
        await asyncio.sleep(0)
        await bridge.reshard(ShardSet(half, DEFAULT_SHARDS, frozenset()))
        released = list(seen)
        assert registry.keys == set(keys) - given
        assert not given & bridge.pool.baselines_of(RELAY), "released keys' baselines are let go"

        adopted_before = bridge._relays.rows_adopted
        seen.clear()
        await bridge.reshard(ShardSet(every, DEFAULT_SHARDS, every - half))
        loaded = list(seen)
        done.set()
        await ticker

        assert registry.keys == set(keys)
        assert given <= bridge.pool.baselines_of(RELAY), "arriving keys take the stored baselines"
        assert bridge._relays.rows_adopted - adopted_before == len(given), (
            "only the arriving keys' baselines are read"
        )
        for phase, counts, start, end in (
            ("release", released, KEYS, KEYS - len(given)),
            ("load", loaded, KEYS - len(given), KEYS),
        ):
            steps = [abs(b - a) for a, b in zip([start, *counts], [*counts, end], strict=True)]
            assert max(steps) <= CHUNK, f"{phase}: {max(steps)} keys changed in one loop turn"
            assert any(min(start, end) < c < max(start, end) for c in counts), (
                f"{phase}: the other coroutine never ran mid-way"
            )


async def test_start_up_subscribes_the_loaded_keys_in_chunks(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bridge starting with many keys subscribes them a chunk per turn of the event loop
    (the lease heartbeats wait otherwise), and ends with every key subscribed."""
    monkeypatch.setattr("sigil_push.bridge.keys.RESHARD_CHUNK", CHUNK)
    keys = [secrets.token_hex(32) for _ in range(KEYS)]
    async with _firehose_instance(postgres_url, tmp_path, keys) as (config, store, observations):
        bridge = await Bridge.create(
            config, store.devices, store.outbox, observations, SecretKey.generate()
        )
        seen: list[int] = []
        done = asyncio.Event()

        async def other_coroutine() -> None:
            while not done.is_set():
                subs = bridge._pool.subs.get(RELAY)
                seen.append(len(subs.keys) if subs is not None else 0)
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other_coroutine())
        await bridge.start()
        done.set()
        await ticker
        assert len(bridge._pool.subs[RELAY].keys) == KEYS
        assert bridge._pool.subs[RELAY].firehose, "the mode is chosen for every key at once"
        steps = [b - a for a, b in zip([0, *seen], [*seen, KEYS], strict=True)]
        assert max(steps) <= CHUNK, f"{max(steps)} keys subscribed in one loop turn"
        assert any(0 < count < KEYS for count in seen), "the loop never turned mid-way"
        await bridge.stop()
        await bridge.close()


async def test_a_restart_reads_only_its_shards_baselines(
    postgres_url: str, tmp_path: Path
) -> None:
    """A worker starting with half the shards reads the stored baselines of those shards' keys
    only (narrowed in the query, not every row filtered here), and holds every one of them;
    one starting with no shards (the others hold them all) reads none."""
    keys = [secrets.token_hex(32) for _ in range(4_000)]
    async with _firehose_instance(postgres_url, tmp_path, keys) as (config, store, observations):
        for held in (frozenset(range(0, DEFAULT_SHARDS, 2)), frozenset()):
            bridge = await Bridge.create(
                config, store.devices, store.outbox, observations, SecretKey.generate()
            )
            ours = {key for key in keys if shard_of(key) in held}
            store.devices.narrow_to(held, DEFAULT_SHARDS)
            await bridge.reshard(ShardSet(held, DEFAULT_SHARDS, held))
            await bridge.start()
            assert bridge.pool.baselines_of(RELAY) == ours
            assert bridge._relays.rows_loaded == len(ours), "other shards' rows were read"
            subs = bridge._pool.subs.get(RELAY)
            assert set(subs.keys if subs is not None else ()) == ours
            await bridge.stop()
            await bridge.close()


def test_a_million_baselines_are_written_in_slices() -> None:
    """A firehose's EOSE baselines every key at once; the committer gets them a slice per
    transaction, in order, so no transaction holds row locks another worker waits on for
    long (its lock timeout is 5 s)."""
    pending = Pending()
    keys = sorted(secrets.token_hex(32) for _ in range(2 * OP_ROWS_PER_COMMIT + 5))
    queued: list[DbOp] = [(DELETE_BASELINES_OF, [("a" * 64,)]),
                          (INSERT_BASELINES, [(RELAY, key, 1) for key in keys])]
    for op, rows in queued:
        pending.add_op(op, rows)
    written: list[tuple[Any, ...]] = []
    slices = 0
    while pending:
        batch, ops = pending.take()
        assert not batch
        rows = [row for _, op_rows in ops for row in op_rows]
        assert 0 < len(rows) <= OP_ROWS_PER_COMMIT
        written.extend(rows)
        slices += 1
    assert slices == 3
    assert written == [row for _, rows in in_lock_order(queued) for row in rows]
    assert len(written) == len(keys) + 1


def test_lock_order_keeps_what_the_writes_leave() -> None:
    """Baseline writes in (pubkey, relay) order leave the table as the queued order did:
    a pair's writes keep their order, and forgetting a key undoes its earlier writes only."""
    rng = random.Random(7)
    keys = [f"{i:064x}" for i in range(6)]
    relays = ["wss://a", "wss://b", "wss://c"]
    for _ in range(300):
        ops: list[DbOp] = [(DELETE_RELAY_LISTS, [("x",)])]
        for _ in range(rng.randint(1, 8)):
            kind = rng.random()
            if kind < 0.5:
                ops.append((INSERT_BASELINES, [(rng.choice(relays), k, rng.randint(1, 9))
                                               for k in rng.sample(keys, 3)]))
            elif kind < 0.8:
                ops.append((DELETE_BASELINE, [(rng.choice(relays), rng.choice(keys))]))
            else:
                ops.append((DELETE_BASELINES_OF, [(rng.choice(keys),)]))
        start = [(r, k, 0) for r in relays for k in keys if rng.random() < 0.3]
        results = []
        for written in (ops, in_lock_order(ops)):
            db = sqlite3.connect(":memory:")
            db.execute("CREATE TABLE relay_baselines (relay TEXT, pubkey TEXT, baselined_at"
                       " INTEGER, PRIMARY KEY (relay, pubkey))")
            db.execute("CREATE TABLE relay_lists (pubkey TEXT)")
            db.executemany("INSERT INTO relay_baselines VALUES (?, ?, ?)", start)
            for op, rows in written:
                db.executemany(BOOKKEEPING_SQL[op], rows)
            results.append(sorted(db.execute("SELECT * FROM relay_baselines")))
            order = [(row[1], row[0]) for op, rows in written
                     if op in (INSERT_BASELINES, DELETE_BASELINE) for row in rows]
            if written is not ops:
                assert order == sorted(order), "pair writes in (pubkey, relay) order"
        assert results[0] == results[1], ops


async def _lock_waiting(watcher: asyncpg.Connection, pid: int) -> bool:
    return bool(await watcher.fetchval(
        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
    ))


async def _race(url: str, first: list[DbOp], second: list[DbOp]) -> list[BaseException | None]:
    """Two workers' committer transactions, taking turns statement by statement: each runs
    its next row write; one that waits on the other's lock is left waiting, and the other
    goes on. Ends when both have committed or failed; returns each one's error."""
    watcher = await asyncpg.connect(url)
    connections = [await asyncpg.connect(url) for _ in range(2)]
    writers: list[dict[str, Any]] = []
    for connection, ops in zip(connections, (first, second), strict=True):
        await connection.execute("BEGIN")
        statements = [(numbered(BOOKKEEPING_SQL[op]), row) for op, rows in ops for row in rows]
        statements.append(("COMMIT", ()))
        writers.append({"c": connection, "pid": connection.get_server_pid(),
                        "todo": statements, "task": None, "error": None, "over": False})
    try:
        while not all(w["over"] for w in writers):
            for w in writers:
                if w["over"]:
                    continue
                task = w["task"]
                if task is not None:
                    if not task.done():
                        continue
                    w["task"] = None
                    if task.exception() is not None:
                        w["error"], w["over"] = task.exception(), True
                        await w["c"].execute("ROLLBACK")
                        continue
                if not w["todo"]:
                    w["over"] = True
                    continue
                sql, row = w["todo"].pop(0)
                w["task"] = asyncio.create_task(w["c"].execute(sql, *row))
                deadline = asyncio.get_running_loop().time() + scaled(60)
                while not w["task"].done() and not await _lock_waiting(watcher, w["pid"]):
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.01)
        return [w["error"] for w in writers]
    finally:
        for connection in [*connections, watcher]:
            await connection.close()


async def test_overlapping_baseline_writers_do_not_deadlock(postgres_url: str) -> None:
    """Two workers overlapping on two keys during a hand-over, each baselining them on two
    relays in the order its EOSEs came (opposite orders). As queued, PostgreSQL finds a
    deadlock and aborts one of them (its batch's wakeups would be retried, then lost); in lock
    order both commit, and every row is there."""
    await migrate(postgres_url)
    low, high = "0" * 64, "f" * 64
    first: list[DbOp] = [(INSERT_BASELINES, [("wss://a", low, 1)]),
                         (INSERT_BASELINES, [("wss://b", high, 1)])]
    second: list[DbOp] = [(INSERT_BASELINES, [("wss://b", high, 2)]),
                          (INSERT_BASELINES, [("wss://a", low, 2)])]

    as_queued = await _race(postgres_url, first, second)
    assert any(isinstance(e, asyncpg.DeadlockDetectedError) for e in as_queued), as_queued

    connection = await asyncpg.connect(postgres_url)
    try:
        await connection.execute("DELETE FROM relay_baselines")
        ordered = await _race(postgres_url, in_lock_order(first), in_lock_order(second))
        assert ordered == [None, None]
        rows = await connection.fetch("SELECT relay, pubkey FROM relay_baselines")
        assert sorted(tuple(r) for r in rows) == [("wss://a", low), ("wss://b", high)]
    finally:
        await connection.close()


async def test_many_baselines_are_sorted_a_chunk_per_loop_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A firehose's EOSE baselines every key at once: the keys are sorted a chunk per turn of
    the event loop (a million in one piece stalled it for seconds, past a 3 s lease), and the
    write keeps its place in the queue meanwhile: nothing queued after it (a key leaving that
    relay at once) is taken before it, so that key's deletion still comes after its insert."""
    monkeypatch.setattr("sigil_push.bridge.relay_state.SORT_CHUNK", CHUNK)
    pending = Pending()
    state = RelayState(
        cast(RelayStateStore, None), cast(RelayLists, None), pending, asyncio.Event()
    )
    keys = frozenset(secrets.token_hex(32) for _ in range(5 * CHUNK))
    leaving = min(keys)
    state.baselined(RELAY, keys)
    state.forget_baselines([(RELAY, leaving)])
    sizes: list[int] = []
    rows = pending._ops[0][1]
    while not pending:
        assert pending.take() == ([], []), "an op was taken while the baselines were sorted"
        sizes.append(len(rows))
        assert len(sizes) < 10_000, "never sorted"
        await asyncio.sleep(0)
    await state.sorting_done()
    assert max(b - a for a, b in zip([0, *sizes], sizes, strict=False)) <= 2 * CHUNK
    assert len([s for s in sizes if 0 < s < len(keys)]) > 1, "the loop never turned mid-way"
    _, ops = pending.take()
    written = [(op, row[1]) for op, op_rows in ops for row in op_rows]
    inserts = [key for op, key in written if op == INSERT_BASELINES]
    assert inserts == sorted(keys)
    assert written.index((DELETE_BASELINE, leaving)) > written.index((INSERT_BASELINES, leaving))


async def test_a_narrowed_key_read_skips_shards_given_back_meanwhile(
    postgres_url: str, tmp_path: Path
) -> None:
    """A worker takes every shard at start-up and gives half back a second later, while it is
    still reading its keys: the rest of the read skips the shards given back (read a group of
    shards per query), so it reads its half of a million keys, not all of them."""
    await migrate(postgres_url)
    keys = [secrets.token_hex(32) for _ in range(4_000)]
    await _store(postgres_url, keys)
    config = parse_config({"server": {"database": postgres_url}}, tmp_path / "relays.toml")
    store = await open_store(config)
    kept = frozenset(range(DEFAULT_SHARDS // 2))
    try:
        store.devices.narrow_to(range(DEFAULT_SHARDS), DEFAULT_SHARDS)
        read: set[str] = set()
        async for chunk in store.devices.key_chunks():
            read.update(chunk)
            store.devices.narrow_to(kept, DEFAULT_SHARDS)  # given back after the first chunk
        assert read == {key for key in keys if shard_of(key) in kept}
    finally:
        await store.close()
