"""The committer's SQLite unit of work (`store.sqlite.bridge_state.transaction`) when the task
holding it is cancelled. aiosqlite runs each statement on the connection's own thread: a
cancelled `await` gives up waiting, not the statement, so a `BEGIN IMMEDIATE` cancelled while
it waits for another connection's lock still opens its transaction once the lock is free. Left
open, every later `BEGIN` on the connection fails ("cannot start a transaction within a
transaction", SQLITE_ERROR, not worth a retry) and the committer skips its batches as poison:
as a paired run's catch-up story saw when its bridge, stopped mid-catch-up, failed a batch of
397 DMs and then every write."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import aiosqlite
import pytest

from sigil_push.store.sqlite.bridge_state import SqliteRelayState, transaction
from sigil_push.store.sqlite.database import open_database
from testkit.deadlines import CONDITION_SECONDS, scaled


async def _write_cursor(db: aiosqlite.Connection, relay: str) -> None:
    async with transaction(db):
        await SqliteRelayState(db).save_cursors([(relay, 1)])


async def _cursors(db: aiosqlite.Connection) -> list[str]:
    return sorted(await SqliteRelayState(db).cursors())


@contextlib.asynccontextmanager
async def _with_another_connection(
    path: Path, busy_seconds: float
) -> AsyncIterator[tuple[aiosqlite.Connection, sqlite3.Connection]]:
    """The store's connection to a new database at `path`, waiting up to `busy_seconds` for
    a lock, and a plain second connection to take the file's lock with."""
    db = await open_database(path)
    other = sqlite3.connect(path, isolation_level=None, timeout=scaled(CONDITION_SECONDS))
    try:
        await db.execute(f"PRAGMA busy_timeout={int(busy_seconds * 1000)}")
        yield db, other
    finally:
        other.close()
        await db.close()


async def test_a_transaction_cancelled_while_it_waits_for_the_lock_leaves_none_open(
    tmp_path: Path,
) -> None:
    # the BEGIN waits out the other connection's lock however slow this machine is, so it
    # does open its transaction after the cancellation
    async with _with_another_connection(
        tmp_path / "push.db", scaled(CONDITION_SECONDS)
    ) as (db, holder):
        loop = asyncio.get_running_loop()
        waiting = asyncio.Event()

        def traced(statement: str) -> None:  # on aiosqlite's thread, as SQLite starts it
            if statement == "BEGIN IMMEDIATE":
                loop.call_soon_threadsafe(waiting.set)

        await db.set_trace_callback(traced)
        holder.execute("BEGIN EXCLUSIVE")
        writer = asyncio.create_task(_write_cursor(db, "wss://cancelled"))
        await asyncio.wait_for(waiting.wait(), scaled(CONDITION_SECONDS))
        writer.cancel()
        holder.execute("ROLLBACK")
        with pytest.raises(asyncio.CancelledError):
            await writer

        await _write_cursor(db, "wss://next")
        assert not db.in_transaction
        assert await _cursors(db) == ["wss://next"]
        # and the file's write lock is free for the other connections
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("ROLLBACK")


async def test_a_transaction_cancelled_in_its_body_is_rolled_back_and_stays_cancelled(
    tmp_path: Path,
) -> None:
    db = await open_database(tmp_path / "push.db")
    try:
        inside = asyncio.Event()

        async def write_then_wait() -> None:
            async with transaction(db):
                await SqliteRelayState(db).save_cursors([("wss://rolled", 1)])
                inside.set()
                await asyncio.Event().wait()

        writer = asyncio.create_task(write_then_wait())
        await asyncio.wait_for(inside.wait(), scaled(CONDITION_SECONDS))
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        assert not db.in_transaction
        assert await _cursors(db) == []
    finally:
        await db.close()


async def test_a_failed_begin_raises_its_own_error_and_leaves_no_transaction(
    tmp_path: Path,
) -> None:
    async with _with_another_connection(tmp_path / "push.db", 0) as (db, holder):
        holder.execute("BEGIN EXCLUSIVE")
        with pytest.raises(sqlite3.OperationalError) as refused:
            await _write_cursor(db, "wss://refused")
        assert refused.value.sqlite_errorcode == sqlite3.SQLITE_BUSY
        holder.execute("ROLLBACK")
        assert not db.in_transaction
        await _write_cursor(db, "wss://next")
        assert await _cursors(db) == ["wss://next"]
