"""Every test that touches the store runs once on SQLite and once on PostgreSQL.

`store_backend` is the one parametrised fixture (ids `sqlite`, `postgres`); everything else
builds on it: `engine` hands out fresh `server.database` values for service processes and
in-process bridges, `database`/`store` open a store directly, `service` is the shared API
service. A test that is genuinely about one engine does not take them, and says why.

PostgreSQL costs one server per session (testkit.postgres) and, per database, a copy of a
template migrated once (`CREATE DATABASE ... TEMPLATE`), so every test starts from an empty,
fully migrated schema; the copies are made ahead of need while earlier tests run.
"""

from __future__ import annotations

import asyncio
import queue
import re
import sqlite3
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite
import asyncpg
import pytest

from sigil_push.store.factory import PostgresStore, SqliteStore, open_postgres, open_sqlite
from sigil_push.store.interface import RelayStateStore, SeenRows
from sigil_push.store.postgres.bridge_state import PostgresRelayState, PostgresSeenRows
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.migrate import migrate
from sigil_push.store.sqlite.bridge_state import SqliteRelayState, SqliteSeenRows
from testkit.deadlines import COMMAND_SECONDS, REQUEST_SECONDS, STARTUP_SECONDS, scaled
from testkit.postgres import PostgresServer
from testkit.service import ServiceProcess

BACKENDS = ("sqlite", "postgres")
_TEMPLATE = "sigil_template"


async def _create_template(server: PostgresServer) -> None:
    admin = await asyncpg.connect(server.url())
    try:
        await admin.execute(f"CREATE DATABASE {_TEMPLATE}")
    finally:
        await admin.close()
    await migrate(server.url(_TEMPLATE))


class _DatabaseStock:
    """Fresh databases copied from the template ahead of need, by a thread of their own.

    A copy costs a few tenths of a second of the server's time (more on a loaded machine) and
    the suite asks for hundreds; made while the previous test waits on its processes, the
    copy is ready when the next test asks. The thread keeps `AHEAD` in stock and ends with the
    server (its next CREATE fails)."""

    AHEAD = 2

    def __init__(self, server: PostgresServer) -> None:
        self.server = server
        self.ready: queue.Queue[str] = queue.Queue()
        self.wanted = threading.Semaphore(self.AHEAD)
        self.failure: BaseException | None = None
        threading.Thread(target=self._fill, daemon=True).start()

    def _fill(self) -> None:
        """The thread's loop: the semaphore is taken here, outside any event loop, so the
        thread never holds the interpreter's exit."""
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(_create_template(self.server))
            admin = loop.run_until_complete(asyncpg.connect(self.server.url()))
            while True:
                self.wanted.acquire()
                name = f"t_{uuid.uuid4().hex[:16]}"
                loop.run_until_complete(
                    admin.execute(f"CREATE DATABASE {name} TEMPLATE {_TEMPLATE}")
                )
                self.ready.put(self.server.url(name))
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as failure:
            # the server stopped, or a real fault: the test that asks next reports it
            self.failure = failure
            self.ready.put("")

    def take(self) -> str:
        url = self.ready.get(timeout=scaled(STARTUP_SECONDS))
        if not url:
            self.ready.put("")
            raise RuntimeError("no fresh PostgreSQL database") from self.failure
        self.wanted.release()
        return url


_stocks: dict[int, _DatabaseStock] = {}
_stocks_lock = threading.Lock()


def _stock(server: PostgresServer) -> _DatabaseStock:
    with _stocks_lock:
        if server.port not in _stocks:
            _stocks[server.port] = _DatabaseStock(server)
        return _stocks[server.port]


async def fresh_postgres_database(server: PostgresServer) -> str:
    """The URL of a new database holding the migrated, empty schema (copied from a template
    migrated once per server, ahead of need)."""
    return await asyncio.to_thread(_stock(server).take)


def _outside_the_loop(work: Any) -> Any:
    """Run coroutine `work` to completion from synchronous code, whether or not this thread is
    already running an event loop (sync helpers are called from async tests too)."""
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, work).result()


def new_postgres_database(server: PostgresServer) -> str:
    """`fresh_postgres_database` for synchronous callers."""
    return _stock(server).take()


@pytest.fixture(params=BACKENDS)
def store_backend(request: pytest.FixtureRequest) -> str:
    """"sqlite" or "postgres"; tests that take it run on both engines."""
    return str(request.param)


@dataclass(frozen=True)
class Engine:
    """The parametrised engine of one test, as the `server.database` values it hands out."""

    name: str
    server: PostgresServer | None

    @property
    def postgres(self) -> bool:
        return self.server is not None

    def database(self, sqlite_file: str = "sigil-push.db") -> str:
        """A fresh store: `sqlite_file` (a relative path lies in the config's folder, so each
        service folder has its own), or a new, migrated PostgreSQL database."""
        return sqlite_file if self.server is None else new_postgres_database(self.server)


    def at_rest(self, database: str) -> bytes:
        """Every byte the engine keeps on disk for `database`, as an attacker holding the disk
        would read them: the SQLite file with its journal files, or, after a checkpoint, the
        PostgreSQL database's own relation files."""
        if self.server is None:
            path = Path(database)
            return b"".join(p.read_bytes() for p in sorted(path.parent.glob(path.name + "*")))
        oid = fetch(database, "SELECT oid FROM pg_database WHERE datname = current_database()")
        fetch(database, "CHECKPOINT")
        folder = self.server.data / "base" / str(oid[0][0])
        return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())

    def dump(self, database: str) -> str:
        """The database as SQL text (sqlite3's iterdump, or pg_dump)."""
        if self.server is None:
            with sqlite3.connect(database) as connection:
                return "\n".join(connection.iterdump())
        done = subprocess.run(
            [str(self.server.binaries / "pg_dump"), database], check=True, capture_output=True,
            text=True, timeout=scaled(COMMAND_SECONDS),
        )
        return done.stdout


def engine_of(backend: str, request: pytest.FixtureRequest) -> Engine:
    """The `Engine` named `backend`, for fixtures that pair the engine with other parameters;
    its PostgreSQL variant uses the session's one server."""
    if backend == "sqlite":
        return Engine("sqlite", None)
    return Engine("postgres", request.getfixturevalue("postgres_server"))


@pytest.fixture
def engine(store_backend: str, request: pytest.FixtureRequest) -> Engine:
    """The test's engine."""
    return engine_of(store_backend, request)


@pytest.fixture
async def database(store_backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A `server.database` value for a fresh, migrated store of the parametrised engine."""
    if store_backend == "sqlite":
        return str(tmp_path / "store.db")
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return await fresh_postgres_database(server)


async def open_test_store(database: str, worker_id: str = "w1") -> SqliteStore | PostgresStore:
    if database.startswith("postgresql://"):
        return await open_postgres(database, worker_id, 60_000)
    return await open_sqlite(Path(database))


@asynccontextmanager
async def opened(database: str) -> AsyncIterator[SqliteStore | PostgresStore]:
    """`open_test_store`, closed on the way out."""
    store = await open_test_store(database)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def store(database: str) -> AsyncIterator[SqliteStore | PostgresStore]:
    """An open store on the parametrised engine, closed after the test."""
    async with opened(database) as store:
        yield store


_PLACEHOLDER = re.compile(r"\?")
_QUOTED = re.compile(r"'[^']*'")


def numbered(sql: str) -> str:
    """A test's portable statement (`?` placeholders) in PostgreSQL's `$1, $2, ...` form,
    quoted literals left alone. For the tests' own SQL only: sigil-push writes each
    engine's SQL in that engine's repositories and never translates."""
    parts = []
    position = 0
    for literal in _QUOTED.finditer(sql):
        parts.append((sql[position : literal.start()], True))
        parts.append((literal.group(0), False))
        position = literal.end()
    parts.append((sql[position:], True))
    counter = 0

    def number(_: re.Match[str]) -> str:
        nonlocal counter
        counter += 1
        return f"${counter}"

    return "".join(_PLACEHOLDER.sub(number, text) if code else text for text, code in parts)


class PortableSql:
    """A test's view of an open store's connection for its own checks and set-ups, written
    once with `?` placeholders for both engines (sigil-push itself reaches its tables only
    through the store's repositories)."""

    def __init__(self, db: aiosqlite.Connection | PostgresDatabase) -> None:
        self._db = db

    async def execute_fetchall(
        self, sql: str, parameters: Sequence[Any] = ()
    ) -> list[tuple[Any, ...]]:
        if isinstance(self._db, PostgresDatabase):
            return [tuple(row) for row in await self._db.fetch(numbered(sql), *parameters)]
        return [tuple(row) for row in await self._db.execute_fetchall(sql, tuple(parameters))]

    async def execute(self, sql: str, parameters: Sequence[Any] = ()) -> int:
        """Run one statement; returns the rows it changed."""
        if isinstance(self._db, PostgresDatabase):
            return await self._db.run(numbered(sql), *parameters)
        cursor = await self._db.execute(sql, tuple(parameters))
        changed = int(cursor.rowcount)
        await cursor.close()
        return changed

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if isinstance(self._db, PostgresDatabase):
            await self._db.many(numbered(sql), rows)
        else:
            await self._db.executemany(sql, rows)


def sql_of(store: Any) -> PortableSql:
    """`PortableSql` on a store's (or a bridge link's) connection."""
    return PortableSql(store.db)


def seen_rows(store: Any) -> SeenRows:
    """The engine's `SeenRows` on an open store's connection (the bridge keeps its own on its
    committer's connection; tests of `SeenEvents` use the store's)."""
    if isinstance(store, PostgresStore):
        return PostgresSeenRows(store.db)
    return SqliteSeenRows(store.db)


def relay_state(store: Any) -> RelayStateStore:
    """The engine's `RelayStateStore` on an open store's connection."""
    if isinstance(store, PostgresStore):
        return PostgresRelayState(store.db)
    return SqliteRelayState(store.db)


async def _fetch_postgres(url: str, sql: str, parameters: Sequence[Any]) -> list[tuple[Any, ...]]:
    connection = await asyncpg.connect(url)
    try:
        return [tuple(row) for row in await connection.fetch(numbered(sql), *parameters)]
    finally:
        await connection.close()


def fetch(database: str, sql: str, parameters: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """The rows of one portable query (`?` placeholders) on a store that a service process owns,
    read from outside it the way an operator would: sqlite3 on the file, or a connection of
    its own to the PostgreSQL database. Callable from sync and async tests alike."""
    if database.startswith("postgresql://"):
        return list(_outside_the_loop(_fetch_postgres(database, sql, parameters)))
    with sqlite3.connect(database, timeout=scaled(REQUEST_SECONDS)) as connection:
        return [tuple(row) for row in connection.execute(sql, tuple(parameters))]


def on_database(
    service: ServiceProcess, url: str, public_url: str | None = None, key_file: Path | None = None
) -> ServiceProcess:
    """Point a not yet started service process at database `url`; for a further worker of one
    instance, at the first worker's public URL (as behind one load balancer) and at the
    instance's bridge key file (every worker shares the key)."""
    service.use_database(url)
    text = service.config_path.read_text()
    if key_file is not None:
        text = text.replace("[server]\n", f'[server]\nsecret_key_file = "{key_file}"\n', 1)
    if public_url is not None:
        text = re.sub(r'public_url = "[^"]*"', f'public_url = "{public_url}"', text)
    service.config_path.write_text(text)
    return service


def backend_service(
    backend: str, request: pytest.FixtureRequest, service: ServiceProcess
) -> ServiceProcess:
    """`service` (not yet started) as is for SQLite, or on a fresh PostgreSQL database; for
    module- or session-scoped fixtures parametrised over BACKENDS."""
    if backend == "sqlite":
        return service
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return on_database(service, new_postgres_database(server))


@pytest.fixture(scope="session", params=BACKENDS)
def service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """A dry-run sigil-push with no relays and no rate limits, shared by API tests; once on a
    SQLite file and once on PostgreSQL, so every API behaviour is checked on both engines."""
    folder = tmp_path_factory.mktemp(f"service-{request.param}")
    with backend_service(request.param, request, ServiceProcess(folder)) as running:
        yield running
