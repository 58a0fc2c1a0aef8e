"""A `Database` handle over asyncpg: the portable `?`-placeholder SQL runs on PostgreSQL.

The modules whose SQL is the same on both engines (seen ids, NIP-98 ids, relay lists, the
bridge's baselines and cursors, delegated-auth sessions, the bridge key) talk to this handle
exactly as they talk to an aiosqlite connection. Placeholders are numbered (`?` → `$n`),
SQLite's `BEGIN IMMEDIATE` becomes `BEGIN`, and `PRAGMA`s (SQLite tuning) are no-ops. A
many-row `INSERT ... VALUES (?, ...)` given to `executemany` runs as one INSERT over arrays
(`unnest`), in the rows' order: asyncpg's executemany binds and executes the statement once
per row, and for the bridge's per-event rows (`seen_events`, `relay_baselines`) that per-row
execution was most of PostgreSQL's CPU in a commit.

A handle either borrows a pool connection per statement (the shared handle: API, delivery) or
owns one connection (the bridge committer, whose batches are one transaction each).
Engine-specific code (device pairs, outbox claims) uses `fetch`/`fetchval`/`run` with native
`$n` SQL on the same handle, so it can share the committer's transaction.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

Connection = asyncpg.Connection | PoolConnectionProxy

BROKEN = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
)
"""Errors after which a connection cannot be trusted with the next statement."""
_PLACEHOLDER = re.compile(r"\?")
_QUOTED = re.compile(r"'[^']*'")
_ROWS = re.compile(r"^\s*(SELECT|WITH|VALUES)\b|\bRETURNING\b", re.IGNORECASE)
_ROW_INSERT = re.compile(
    r"^\s*INSERT INTO (\w+) \(([\w, ]+)\) VALUES \((\?(?:, ?\?)*)\)"
    r"(\s+ON CONFLICT(?: \([\w, ]+\))? DO NOTHING)?\s*$",
    re.IGNORECASE,
)
"""An INSERT of one row whose outcome does not depend on the other rows of its batch: without
ON CONFLICT a duplicate fails the batch either way, and DO NOTHING skips a row already there
or earlier in the same statement alike (DO UPDATE would touch a row twice and fail)."""


def numbered(sql: str) -> str:
    """`?` placeholders as PostgreSQL's `$1, $2, ...` (quoted literals left alone)."""
    parts = []
    counter = 0
    position = 0
    for literal in _QUOTED.finditer(sql):
        parts.append((sql[position : literal.start()], True))
        parts.append((literal.group(0), False))
        position = literal.end()
    parts.append((sql[position:], True))

    def number(_: re.Match[str]) -> str:
        nonlocal counter
        counter += 1
        return f"${counter}"

    return "".join(_PLACEHOLDER.sub(number, text) if code else text for text, code in parts)


def _dialect(sql: str) -> str | None:
    """The PostgreSQL form of a statement, or None for one that means nothing there."""
    head = sql.lstrip()[:16].upper()
    if head.startswith("PRAGMA"):
        return None
    if head.startswith("BEGIN IMMEDIATE"):
        return "BEGIN"
    return numbered(sql)


def _rowcount(status: str) -> int:
    """The row count in a command tag such as `DELETE 3` or `INSERT 0 1`."""
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else -1


_UNNEST_INSERTS: dict[str, str] = {}
"""`executemany`'s one-row INSERTs, as their one-statement form over arrays."""


class _Cursor:
    """Rows already fetched, read through the cursor methods callers expect."""

    def __init__(self, rows: Sequence[Any], rowcount: int) -> None:
        self._rows = list(rows)
        self._next = 0
        self.rowcount = rowcount

    async def fetchone(self) -> Any:
        if self._next >= len(self._rows):
            return None
        self._next += 1
        return self._rows[self._next - 1]

    async def fetchall(self) -> list[Any]:
        rest, self._next = self._rows[self._next :], len(self._rows)
        return rest

    async def close(self) -> None:
        self._rows = []

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while (row := await self.fetchone()) is not None:
            yield row


class _Pending:
    """`execute`'s result: awaited for a cursor, or used in `async with`, like aiosqlite's."""

    def __init__(self, database: PostgresDatabase, sql: str, parameters: Sequence[Any]) -> None:
        self._database = database
        self._sql = sql
        self._parameters = parameters

    def __await__(self) -> Generator[Any, None, _Cursor]:
        return self._database._cursor(self._sql, self._parameters).__await__()

    async def __aenter__(self) -> _Cursor:
        return await self._database._cursor(self._sql, self._parameters)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


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
                if self._owned.is_closed() and self._reconnect is not None:
                    self._owned = await self._reconnect()
                try:
                    yield self._owned
                except BROKEN:
                    self._owned.terminate()  # whatever state it is in, the next use starts afresh
                    raise
        else:
            assert self._pool is not None
            async with self._pool.acquire() as borrowed:
                yield borrowed

    async def _cursor(self, sql: str, parameters: Sequence[Any]) -> _Cursor:
        statement = _dialect(sql)
        if statement is None:
            return _Cursor([], -1)
        async with self.connection() as connection:
            if not parameters and statement in ("BEGIN", "COMMIT", "ROLLBACK"):
                await connection.execute(statement)
                return _Cursor([], -1)
            if _ROWS.search(statement):
                rows = await connection.fetch(statement, *parameters)
                return _Cursor(rows, len(rows))
            status = await connection.execute(statement, *parameters)
            return _Cursor([], _rowcount(status))

    def execute(self, sql: str, parameters: Iterable[Any] | None = None) -> _Pending:
        return _Pending(self, sql, tuple(parameters or ()))

    async def execute_fetchall(
        self, sql: str, parameters: Iterable[Any] | None = None
    ) -> list[Any]:
        cursor = await self._cursor(sql, tuple(parameters or ()))
        return await cursor.fetchall()

    async def executemany(self, sql: str, parameters: Iterable[Iterable[Any]]) -> _Cursor:
        rows = [tuple(row) for row in parameters]
        if not rows:
            return _Cursor([], -1)
        single = numbered(sql)
        insert = _ROW_INSERT.match(sql) if len(rows) > 1 else None
        async with self.connection() as connection:
            if insert is None:
                await connection.executemany(single, rows)
            else:
                statement = await self._unnest_insert(connection, sql, single, insert)
                await connection.execute(statement, *(list(c) for c in zip(*rows, strict=True)))
        return _Cursor([], -1)

    async def _unnest_insert(
        self, connection: Connection, sql: str, single: str, insert: re.Match[str]
    ) -> str:
        """The INSERT of `sql`'s rows as one statement over one array per column, typed as the
        one-row statement's parameters (learnt once per statement text)."""
        statement = _UNNEST_INSERTS.get(sql)
        if statement is None:
            prepared = await connection.prepare(single)
            types = [f"{t.schema}.{t.name}" for t in prepared.get_parameters()]
            table, columns, _, conflict = insert.groups()
            names = [c.strip() for c in columns.split(",")]
            if len(types) != len(names):
                raise ValueError(f"cannot batch {sql!r}: one placeholder per column expected")
            arrays = ", ".join(f"${n}::{t}[]" for n, t in enumerate(types, 1))
            statement = (
                f"INSERT INTO {table} ({', '.join(names)}) SELECT * FROM unnest({arrays})"
                f"{conflict or ''}"
            )
            _UNNEST_INSERTS[sql] = statement
        return statement

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        """Native `$n` SQL."""
        async with self.connection() as connection:
            return list(await connection.fetch(sql, *args))

    async def fetchval(self, sql: str, *args: Any) -> Any:
        async with self.connection() as connection:
            return await connection.fetchval(sql, *args)

    async def run(self, sql: str, *args: Any) -> int:
        """Native `$n` SQL without rows; returns how many rows it changed."""
        async with self.connection() as connection:
            return _rowcount(await connection.execute(sql, *args))

    async def close(self) -> None:
        """Close what this handle owns: its connection, or else the pool."""
        if self._owned is not None:
            await self._owned.close()
        elif self._pool is not None:
            await self._pool.close()
