"""`PostgresDatabase` on one owned connection (the bridge committer's) on a real server."""

from __future__ import annotations

import asyncio

import asyncpg

from sigil_push.store.postgres.database import PostgresDatabase


async def test_statements_from_several_tasks_take_turns_on_an_owned_connection(
    postgres_url: str,
) -> None:
    """The bridge's committer, housekeeping and reshard share one connection: statements
    issued at once by several tasks run one after the other, as on one aiosqlite connection,
    instead of asyncpg refusing the second (which used to terminate the connection)."""
    db = PostgresDatabase(await asyncpg.connect(postgres_url))
    try:
        answers = await asyncio.gather(
            *(db.fetchval("SELECT $1::int FROM pg_sleep(0.01)", i) for i in range(20))
        )
        assert answers == list(range(20))
        rows = await db.execute_fetchall("SELECT 1")
        assert [tuple(row) for row in rows] == [(1,)]
    finally:
        await db.close()
