"""The handle every PostgreSQL repository runs its (native, `$n`) SQL on.

A handle either borrows a pool connection per statement (the shared handle: API, delivery) or
owns one connection (the bridge committer, whose batches are one transaction each:
`transaction()`). The repositories of `store.postgres` write PostgreSQL's own SQL; many-row
inserts are one statement over arrays (`unnest`), because asyncpg's executemany binds and
executes a statement once per row, and for the bridge's per-event rows (`seen_events`,
`relay_baselines`) that per-row execution was most of PostgreSQL's CPU in a commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from sigil_push.store.errors import TRANSIENT_ERRORS, StoreUnavailable

Connection = asyncpg.Connection | PoolConnectionProxy

ACQUIRE_SECONDS = 5.0
"""At most this long to get a pool connection (connecting included, see the pool's connect
timeout): a request the database can't serve gets its 503 well within 10 s, not a hang."""

UNREACHABLE = (
    OSError,  # refused, reset, timed out
    asyncpg.PostgresConnectionError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.CannotConnectNowError,
)
"""The server can't be reached or is going away: `StoreUnavailable`, whatever the form."""

BROKEN = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
)
"""Errors after which a connection cannot be trusted with the next statement."""


def _rowcount(status: str) -> int:
    """The row count in a command tag such as `DELETE 3` or `INSERT 0 1`."""
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else -1


class PostgresDatabase:
    """A pool-backed or single-connection handle to one PostgreSQL database.

    An owned connection that broke (server restart, network) is replaced by `reconnect` at the
    next statement, so a long-lived user such as the bridge committer recovers by retrying.
    Statements on an owned connection take turns, as on one aiosqlite connection: the bridge's
    committer, housekeeping and reshard share it, and asyncpg refuses a second operation while
    one is in progress (an InterfaceError, which used to terminate the connection mid-commit).
    """

    def __init__(
        self,
        source: asyncpg.Pool | asyncpg.Connection,
        reconnect: Callable[[], Awaitable[asyncpg.Connection]] | None = None,
    ) -> None:
        self._pool = source if isinstance(source, asyncpg.Pool) else None
        self._owned = source if isinstance(source, asyncpg.Connection) else None
        self._reconnect = reconnect
        self._turn = asyncio.Lock()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Connection]:
        """The owned connection, or one borrowed from the pool for the block."""
        if self._owned is not None:
            async with self._turn:
                try:
                    if self._owned.is_closed() and self._reconnect is not None:
                        self._owned = await self._reconnect()
                    try:
                        yield self._owned
                    except BROKEN:
                        self._owned.terminate()  # whatever state it is in, the next use starts afresh
                        raise
                except UNREACHABLE as exc:
                    raise StoreUnavailable("PostgreSQL", exc) from exc
        else:
            assert self._pool is not None
            try:
                async with self._pool.acquire(timeout=ACQUIRE_SECONDS) as borrowed:
                    yield borrowed
            except UNREACHABLE as exc:
                raise StoreUnavailable("PostgreSQL", exc) from exc

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        """One unit of work on the owned connection: `BEGIN` ... `COMMIT`, or `ROLLBACK` on
        any exception (itself allowed to fail on a broken connection). Each statement takes
        its turn on the connection, as before; the caller's own lock keeps other users of the
        connection out of the transaction (the bridge's `turn`). A `BEGIN` whose wait was
        cancelled may have reached the server all the same, so the rollback covers it too
        (PostgreSQL only warns of a `ROLLBACK` outside a transaction)."""
        if self._owned is None:
            raise RuntimeError("a transaction needs a handle that owns its connection")
        try:
            await self.run("BEGIN")
            yield
            await self.run("COMMIT")
        except BaseException:
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await self.run("ROLLBACK")
            raise

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        async with self.connection() as connection:
            return list(await connection.fetch(sql, *args))

    async def fetchval(self, sql: str, *args: Any) -> Any:
        async with self.connection() as connection:
            return await connection.fetchval(sql, *args)

    async def run(self, sql: str, *args: Any) -> int:
        """Native `$n` SQL without rows; returns how many rows it changed."""
        async with self.connection() as connection:
            return _rowcount(await connection.execute(sql, *args))

    async def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """One statement per row, in the rows' order (for updates and deletes, whose row
        locks must be taken in the order the caller sorted them)."""
        rows = list(rows)
        if rows:
            async with self.connection() as connection:
                await connection.executemany(sql, rows)

    async def close(self) -> None:
        """Close what this handle owns: its connection, or else the pool."""
        if self._owned is not None:
            await self._owned.close()
        elif self._pool is not None:
            await self._pool.close()
