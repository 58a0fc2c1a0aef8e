"""The `store_backend` fixture: store-level tests run once on SQLite and once on PostgreSQL.

PostgreSQL costs one server per session (tests.support.postgres) and, per test, one database
copied from a template that is migrated once (`CREATE DATABASE ... TEMPLATE`), so every test
starts from an empty, fully migrated schema in a few tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from sigil_push.store.factory import PostgresStore, SqliteStore, open_postgres, open_sqlite
from sigil_push.store.postgres.migrate import migrate
from tests.support.postgres import PostgresServer
from tests.support.service import ServiceProcess

BACKENDS = ("sqlite", "postgres")
_TEMPLATE = "sigil_template"


async def _create_template(server: PostgresServer) -> None:
    admin = await asyncpg.connect(server.url())
    try:
        await admin.execute(f"CREATE DATABASE {_TEMPLATE}")
    finally:
        await admin.close()
    await migrate(server.url(_TEMPLATE))


_templates: set[int] = set()


async def fresh_postgres_database(server: PostgresServer) -> str:
    """The URL of a new database holding the migrated, empty schema (copied from a template
    migrated once per server)."""
    if server.port not in _templates:
        await _create_template(server)
        _templates.add(server.port)
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(server.url())
    try:
        await admin.execute(f"CREATE DATABASE {name} TEMPLATE {_TEMPLATE}")
    finally:
        await admin.close()
    return server.url(name)


@pytest.fixture(params=BACKENDS)
def store_backend(request: pytest.FixtureRequest) -> str:
    """"sqlite" or "postgres"; tests that take it run on both engines."""
    return str(request.param)


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


@pytest.fixture
async def store(database: str) -> AsyncIterator[SqliteStore | PostgresStore]:
    """An open store on the parametrised engine, closed after the test."""
    opened = await open_test_store(database)
    try:
        yield opened
    finally:
        await opened.close()


def on_database(
    service: ServiceProcess, url: str, public_url: str | None = None, key_file: Path | None = None
) -> ServiceProcess:
    """Point a not yet started service process at database `url`; for a further worker of one
    instance, at the first worker's public URL (as behind one load balancer) and at the
    instance's bridge key file (every worker shares the key)."""
    text = service.config_path.read_text()
    text = text.replace('database = "sigil-push.db"', f'database = "{url}"')
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
    module- or session-scoped fixtures parametrised over BACKENDS (called outside a loop)."""
    if backend == "sqlite":
        return service
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return on_database(service, asyncio.run(fresh_postgres_database(server)))


@pytest.fixture(scope="session", params=BACKENDS)
def service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """A dry-run sigil-push with no relays and no rate limits, shared by API tests; once on a
    SQLite file and once on PostgreSQL, so every API behaviour is checked on both engines."""
    folder = tmp_path_factory.mktemp(f"service-{request.param}")
    with backend_service(request.param, request, ServiceProcess(folder)) as running:
        yield running
