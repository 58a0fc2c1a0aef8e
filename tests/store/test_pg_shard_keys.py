"""A worker reads only its own shards' keys: `PostgresDevices.watched_keys` once narrowed
returns exactly the keys Python's `shard_of` puts in those shards (computed in SQL, so the
other workers' keys never leave the database), on a real PostgreSQL server.

Prints what narrowing saves when four workers split 40,000 keys.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import pytest

from sigil_push.shards import DEFAULT_SHARDS, fair_share, shard_of
from sigil_push.store.factory import PostgresStore, open_postgres
from sigil_push.store.postgres.devices import shard_keys_sql

KEYS = 40_000
WORKERS = 4


@pytest.fixture
async def store(postgres_url: str) -> AsyncIterator[PostgresStore]:
    opened = await open_postgres(postgres_url, "w1", 60_000)
    try:
        yield opened
    finally:
        await opened.close()


async def test_watched_keys_narrowed_to_shards_match_shard_of(store: PostgresStore) -> None:
    # the extremes of the leading 32 bits, where a signed conversion would go wrong
    edges = ["ffffffff" + secrets.token_hex(28), "00000000" + secrets.token_hex(28),
             "80000000" + secrets.token_hex(28), "7fffffff" + secrets.token_hex(28)]
    keys = edges + [secrets.token_hex(32) for _ in range(KEYS - len(edges))]
    await store.db.run(
        "INSERT INTO devices (pubkey, platform, token, relays, registered_at, updated_at)"
        " SELECT k, 'android', 'token-' || k, '[\"wss://r.example\"]', 0, 0"
        " FROM unnest($1::text[]) AS k",
        keys,
    )
    devices = store.devices

    started = time.perf_counter()
    every = await devices.watched_keys()
    full_s = time.perf_counter() - started
    assert set(every) == set(keys)

    share = fair_share(DEFAULT_SHARDS, WORKERS)
    covered: set[str] = set()
    narrowed_s = []
    for worker in range(WORKERS):
        shards = set(range(worker * share, min(DEFAULT_SHARDS, (worker + 1) * share)))
        devices.narrow_to(shards, DEFAULT_SHARDS)
        started = time.perf_counter()
        mine = await devices.watched_keys()
        narrowed_s.append(time.perf_counter() - started)
        assert set(mine) == {k for k in keys if shard_of(k) in shards}
        assert all(mine[k] == ("wss://r.example",) for k in mine)
        covered |= set(mine)
    assert covered == set(keys), "the workers' narrowed views cover every key once"

    devices.narrow_to([shard_of(k) for k in edges], DEFAULT_SHARDS)
    assert set(edges) <= set(await devices.watched_keys())
    devices.narrow_to([], DEFAULT_SHARDS)
    assert await devices.watched_keys() == {}
    print(f"watched_keys for {KEYS} keys: all {full_s * 1000:.0f} ms; one of {WORKERS} workers"
          f" {max(narrowed_s) * 1000:.0f} ms, about {KEYS // WORKERS} keys")



async def test_narrowed_key_query_reads_the_shard_index(store: PostgresStore) -> None:
    """At 256 shards the planner answers the narrowed query from `devices_by_shard`
    (migration 0005) instead of evaluating the shard of every row of the table."""
    keys = [secrets.token_hex(32) for _ in range(20_000)]
    await store.db.run(
        "INSERT INTO devices (pubkey, platform, token, registered_at, updated_at)"
        " SELECT k, 'android', 'token-' || k, 0, 0 FROM unnest($1::text[]) AS k",
        keys,
    )
    await store.db.run("ANALYZE devices")
    for shards in ([3, 77, 200], list(range(64))):
        plan = await store.db.fetch(
            "EXPLAIN " + shard_keys_sql(DEFAULT_SHARDS), shards
        )
        text = "\n".join(str(row[0]) for row in plan)
        assert "devices_by_shard" in text, text
        store.devices.narrow_to(shards, DEFAULT_SHARDS)
        assert set(await store.devices.watched_keys()) == {
            k for k in keys if shard_of(k) in shards
        }
