"""Single use of NIP-98 auth ids, on each engine (a real SQLite file, a real PostgreSQL)."""

from __future__ import annotations

import asyncio
import time

from sigil_push.store.factory import PostgresStore, SqliteStore
from testkit.stores import open_test_store, sql_of


async def test_an_id_is_claimed_once_and_expired_ids_are_pruned(
    store: SqliteStore | PostgresStore,
) -> None:
    ids = store.auth_ids
    assert await ids.claim("a" * 64)
    assert not await ids.claim("a" * 64)
    await sql_of(store).execute(
        "INSERT INTO nip98_used VALUES (?, ?)", ("b" * 64, int(time.time()) - 1)
    )
    assert await ids.prune() == 1
    assert not await ids.claim("a" * 64)


async def test_concurrent_claims_of_the_same_id_admit_exactly_one(
    store: SqliteStore | PostgresStore,
) -> None:
    """Two requests racing with one auth event: one wins, whether batched together or not."""
    ids = store.auth_ids
    results = await asyncio.gather(*(ids.claim(f"{i % 50:064x}") for i in range(200)))
    assert sum(results) == 50
    again = await asyncio.gather(*(ids.claim(f"{i:064x}") for i in range(60)))
    assert again == [False] * 50 + [True] * 10


async def test_an_id_used_through_one_store_is_refused_through_another(database: str) -> None:
    """Two stores on one database (two workers on PostgreSQL, two processes on one SQLite
    file): the id is single-use across both, because the database holds it, not memory."""
    first, second = await open_test_store(database, "w1"), await open_test_store(database, "w2")
    try:
        results = await asyncio.gather(
            *(store.auth_ids.claim(f"{i:064x}") for i in range(40) for store in (first, second))
        )
        assert sum(results) == 40
        assert not await second.auth_ids.claim(f"{0:064x}")
    finally:
        await first.close()
        await second.close()
