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


async def test_a_many_row_insert_is_one_statement_with_the_same_rows_as_row_by_row(
    postgres_url: str,
) -> None:
    """`executemany` of a one-row INSERT runs as one INSERT over arrays: the rows land as
    they would one by one (NULLs, typed columns, their order, duplicates skipped by ON
    CONFLICT DO NOTHING), and a statement it cannot batch (DO UPDATE) still runs row by row."""
    connection = await asyncpg.connect(postgres_url)
    db = PostgresDatabase(connection)
    try:
        await db.run(
            "CREATE TEMP TABLE t (n BIGSERIAL, k TEXT PRIMARY KEY, v BIGINT, note TEXT)"
        )
        await db.executemany(
            "INSERT INTO t (k, v, note) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            [("b", 2, None), ("a", 1, "x"), ("b", 3, "dup in batch"), ("c", 2**40, "")],
        )
        await db.executemany(
            "INSERT INTO t (k, v, note) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            [("a", 9, "already there"), ("d", 4, "d")],
        )
        rows = await db.fetch("SELECT k, v, note FROM t ORDER BY n")
        assert [tuple(r) for r in rows] == [
            ("b", 2, None), ("a", 1, "x"), ("c", 2**40, ""), ("d", 4, "d")
        ]
        await db.executemany(
            "INSERT INTO t (k, v) VALUES (?, ?) ON CONFLICT (k) DO UPDATE SET v = t.v + 1",
            [("a", 0), ("a", 0)],
        )
        assert await db.fetchval("SELECT v FROM t WHERE k = 'a'") == 3
        # one statement, not one per row: a statement-level trigger counts them
        await db.run("CREATE TEMP TABLE statements (n INT)")
        await db.run(
            "CREATE FUNCTION pg_temp.count_statement() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN INSERT INTO statements VALUES (1); RETURN NULL; END $$"
        )
        await db.run(
            "CREATE TRIGGER counted AFTER INSERT ON t FOR EACH STATEMENT"
            " EXECUTE FUNCTION pg_temp.count_statement()"
        )
        await db.executemany(
            "INSERT INTO t (k, v, note) VALUES (?, ?, ?)", [(f"k{i}", i, None) for i in range(50)]
        )
        assert await db.fetchval("SELECT count(*) FROM t WHERE k LIKE 'k%'") == 50
        assert await db.fetchval("SELECT count(*) FROM statements") == 1
    finally:
        await db.close()
