"""`PostgresDatabase` on one owned connection (the bridge committer's) on a real server, and
the PostgreSQL repositories' batched writes on it."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from sigil_push.store.interface import BookkeepingOp
from sigil_push.store.postgres.bridge_state import PostgresRelayState, PostgresSeenRows
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.migrate import migrate


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
    finally:
        await db.close()


async def _count_statements(db: PostgresDatabase, table: str) -> None:
    """A statement-level trigger on `table` counts the INSERT statements into it."""
    await db.run("CREATE TABLE IF NOT EXISTS statements (tab TEXT)")
    await db.run(
        "CREATE OR REPLACE FUNCTION count_statement() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN INSERT INTO statements VALUES (TG_TABLE_NAME); RETURN NULL; END $$"
    )
    await db.run(
        f"CREATE TRIGGER counted AFTER INSERT ON {table} FOR EACH STATEMENT"
        " EXECUTE FUNCTION count_statement()"
    )


async def test_many_row_inserts_are_one_statement_with_the_rows_of_row_by_row(
    postgres_url: str,
) -> None:
    """The bridge's per-event rows (seen ids, baselines) go in as one INSERT over arrays: the
    rows land as they would one by one (typed columns, duplicates in the batch or already
    there skipped), with one statement per batch, not one per row."""
    await migrate(postgres_url)
    db = PostgresDatabase(await asyncpg.connect(postgres_url))
    try:
        for table in ("seen_events", "relay_baselines"):
            await _count_statements(db, table)
        seen, state = PostgresSeenRows(db), PostgresRelayState(db)
        await seen.insert([(b"b", "wss://x", 2), (b"a", "wss://x", 2**40), (b"b", "wss://dup", 3)])
        await seen.insert([(b"a", "wss://already", 9), (b"c", "wss://y", 4)])
        rows = await db.fetch("SELECT event_id, relay, keep_until FROM seen_events ORDER BY 1")
        assert [tuple(r) for r in rows] == [
            (b"a", "wss://x", 2**40), (b"b", "wss://x", 2), (b"c", "wss://y", 4)
        ]
        await state.apply(
            BookkeepingOp.INSERT_BASELINES, [("wss://x", f"{i:064x}", i) for i in range(50)]
        )
        assert await db.fetchval("SELECT count(*) FROM relay_baselines") == 50
        counted = await db.fetch("SELECT tab, count(*) FROM statements GROUP BY 1 ORDER BY 1")
        assert [tuple(r) for r in counted] == [("relay_baselines", 1), ("seen_events", 2)]
    finally:
        await db.close()


async def test_a_transaction_commits_its_writes_or_none_of_them(postgres_url: str) -> None:
    """The committer's unit of work: a clean exit commits; an exception rolls back every
    write of the block, and the connection serves the next transaction."""
    await migrate(postgres_url)
    db = PostgresDatabase(await asyncpg.connect(postgres_url))
    seen = PostgresSeenRows(db)
    try:
        async with db.transaction():
            await seen.insert([(b"kept", "wss://x", 1)])
        with pytest.raises(RuntimeError):
            async with db.transaction():
                await seen.insert([(b"dropped", "wss://x", 1)])
                raise RuntimeError("a poison batch")
        async with db.transaction():
            await seen.append_relays([(" wss://y", b"kept")])
        rows = await db.fetch("SELECT event_id, relay FROM seen_events")
        assert [tuple(r) for r in rows] == [(b"kept", "wss://x wss://y")]
    finally:
        await db.close()
