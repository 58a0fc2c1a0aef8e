"""`open_store(config)`: the one place that knows which engine `server.database` names.

A path opens the SQLite file (created and migrated); a `postgresql://` URL opens an asyncpg
pool after applying `migrations/postgres/` under the advisory lock, so workers starting
together migrate once. The rest of the service receives a `Store` (and the bridge a
`BridgeConnection`) and never asks which: what differs between one process and several
workers is the store's `coordination`. `migrated_instance` (the CLI's start-up preflight),
`migrate` and `copy_from_sqlite` are the CLI's engine-specific steps, chosen here too.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiosqlite
import asyncpg

from sigil_push.config import STOP_GRACE_SECONDS, Config, ConfigError, is_postgres_url
from sigil_push.identity import MetaStore
from sigil_push.store.auth_ids import UsedAuthIds
from sigil_push.store.interface import (
    AuthIdStore,
    AuthModeStore,
    CatchupItemsStore,
    Coordination,
    DeviceStore,
    IrisSubscriptionStore,
    OutboxStore,
    RelayStateStore,
    SeenRows,
    SignerSessionStore,
    Store,
    UserListStore,
)
from sigil_push.store.postgres.bridge_state import (
    PostgresCatchupItems,
    PostgresRelayState,
    PostgresSeenRows,
)
from sigil_push.store.postgres.coordination import WorkerCoordination, check_instance_key
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.devices import PostgresDevices
from sigil_push.store.postgres.instance import (
    PostgresAuthIdRows,
    PostgresAuthModes,
    PostgresMeta,
    PostgresSignerSessions,
)
from sigil_push.store.postgres.iris import PostgresIrisSubscriptions
from sigil_push.store.postgres.migrate import migrate as migrate_postgres
from sigil_push.store.postgres.migrate import migrate_connection
from sigil_push.store.postgres.outbox import PostgresOutbox
from sigil_push.store.postgres.preferences import PostgresUserLists
from sigil_push.store.sqlite.bridge_state import (
    SqliteCatchupItems,
    SqliteRelayState,
    SqliteSeenRows,
    transaction,
)
from sigil_push.store.sqlite.coordination import SingleProcess
from sigil_push.store.sqlite.database import make_private, open_database
from sigil_push.store.sqlite.database import migrate as migrate_sqlite
from sigil_push.store.sqlite.devices import Devices
from sigil_push.store.sqlite.instance import (
    SqliteAuthIdRows,
    SqliteAuthModes,
    SqliteMeta,
    SqliteSignerSessions,
)
from sigil_push.store.sqlite.iris import SqliteIrisSubscriptions
from sigil_push.store.sqlite.outbox import Outbox
from sigil_push.store.sqlite.preferences import SqliteUserLists

POOL_MAX = 10
CONNECT_SECONDS = 5.0
"""How long a new connection may take (asyncpg's default is 60 s): a database that went away
is reported unavailable within seconds, not after a minute (`database.ACQUIRE_SECONDS`)."""
SESSION_SETTINGS = {"lock_timeout": "5000"}
"""A statement waits at most 5 s for a lock, as SQLite's busy timeout: then the API answers 503
and the bridge retries, instead of hanging behind a stuck transaction."""


def new_worker_id() -> str:
    """Unique per process: host, pid and a random part (a pid is reused after a restart)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def claim_ms_for(config: Config) -> int:
    """An outbox claim outlives any send (two send timeouts plus the stop grace, the horizon
    after which delivery itself gives up on a claim), so only a dead worker's claims lapse."""
    return int((2 * config.push.send_timeout_seconds + STOP_GRACE_SECONDS) * 1000)


@dataclass
class PostgresInstance:
    """A migrated PostgreSQL database as `serve`'s preflight sees it: the instance's facts, and
    the check that a worker's bridge key is the instance's."""

    meta: MetaStore

    async def check_key(self, public_key_hex: str) -> None:
        await check_instance_key(self.meta, public_key_hex)


@asynccontextmanager
async def migrated_instance(config: Config) -> AsyncIterator[PostgresInstance | None]:
    """For the CLI's start-up preflight: a PostgreSQL database reachable and migrated (under
    the lock), on one connection closed afterwards. None for SQLite, which `serve` opens itself."""
    if not is_postgres_url(config.server.database):
        yield None
        return
    connection = await asyncpg.connect(config.server.database)
    try:
        await migrate_connection(connection)
        yield PostgresInstance(PostgresMeta(PostgresDatabase(connection)))
    finally:
        await connection.close()


async def migrate(config: Config) -> list[str]:
    """Apply the configured store's pending migrations; returns the names applied."""
    if is_postgres_url(config.server.database):
        return await migrate_postgres(config.server.database)
    return await migrate_sqlite(config.resolve(config.server.database))


async def copy_from_sqlite(config: Config, source: Path) -> dict[str, int]:
    """Copy a SQLite store into the configured PostgreSQL one (`migrate --from`)."""
    if not is_postgres_url(config.server.database):
        raise ConfigError(
            "server.database", "migrate --from copies into PostgreSQL: set a postgresql:// URL"
        )
    from sigil_push.store.postgres.copy import copy_sqlite

    return await copy_sqlite(source, config.server.database)


@dataclass
class SqliteBridgeLink:
    """`BridgeConnection` on the committer's own SQLite connection."""

    db: aiosqlite.Connection
    outbox: OutboxStore
    seen: SeenRows
    state: RelayStateStore
    lists: UserListStore
    catchup: CatchupItemsStore

    def transaction(self) -> AbstractAsyncContextManager[None]:
        return transaction(self.db)

    async def close(self) -> None:
        await self.db.close()


@dataclass
class PostgresBridgeLink:
    """`BridgeConnection` on the committer's own PostgreSQL connection."""

    db: PostgresDatabase
    outbox: OutboxStore
    seen: SeenRows
    state: RelayStateStore
    lists: UserListStore
    catchup: CatchupItemsStore

    def transaction(self) -> AbstractAsyncContextManager[None]:
        return self.db.transaction()

    async def close(self) -> None:
        await self.db.close()


@dataclass
class SqliteStore:
    """`Store` on one SQLite file (`db`: its connection, for tests and tools only)."""

    path: Path
    db: aiosqlite.Connection
    devices: DeviceStore
    outbox: OutboxStore
    auth_ids: AuthIdStore
    meta: MetaStore
    signer_sessions: SignerSessionStore
    auth_modes: AuthModeStore
    coordination: Coordination
    iris: IrisSubscriptionStore
    engine: str = "sqlite"
    worker_id: str = field(default_factory=new_worker_id)

    async def close(self) -> None:
        await self.db.close()


@dataclass
class PostgresStore:
    """`Store` on a PostgreSQL database shared by any number of workers (`db`: its pooled
    handle, for tests and tools only)."""

    url: str
    db: PostgresDatabase
    pool: asyncpg.Pool
    devices: PostgresDevices
    outbox: OutboxStore
    auth_ids: AuthIdStore
    meta: MetaStore
    signer_sessions: SignerSessionStore
    auth_modes: AuthModeStore
    coordination: Coordination
    worker_id: str
    claim_ms: int
    iris: IrisSubscriptionStore
    engine: str = "postgres"

    async def close(self) -> None:
        await self.devices.close()
        await self.db.close()


async def open_postgres(url: str, worker_id: str, claim_ms: int) -> PostgresStore:
    """Migrate (under the advisory lock), then open the pool."""
    connection = await asyncpg.connect(url)
    try:
        await migrate_connection(connection)
    finally:
        await connection.close()
    pool = await asyncpg.create_pool(
        url, min_size=1, max_size=POOL_MAX, server_settings=SESSION_SETTINGS,
        timeout=CONNECT_SECONDS,
    )
    db = PostgresDatabase(pool)
    devices = PostgresDevices(db, worker_id)
    try:
        await devices.listen(url)
    except BaseException:
        await pool.close()
        raise
    meta = PostgresMeta(db)
    iris = PostgresIrisSubscriptions(db, devices)
    await iris.listen()
    return PostgresStore(
        url, db, pool, devices, PostgresOutbox(db, worker_id, claim_ms),
        UsedAuthIds(PostgresAuthIdRows(db)), meta, PostgresSignerSessions(db),
        PostgresAuthModes(db), WorkerCoordination(pool, devices, meta, worker_id),
        worker_id, claim_ms, iris,
    )


async def open_sqlite(path: Path) -> SqliteStore:
    db = await open_database(path)
    make_private(path)
    return SqliteStore(
        path, db, Devices(db), Outbox(db), UsedAuthIds(SqliteAuthIdRows(db)), SqliteMeta(db),
        SqliteSignerSessions(db), SqliteAuthModes(db), SingleProcess(path),
        SqliteIrisSubscriptions(db),
    )


async def open_store(config: Config) -> Store:
    """The store `server.database` names, open and migrated."""
    database = config.server.database
    if is_postgres_url(database):
        return await open_postgres(database, new_worker_id(), claim_ms_for(config))
    return await open_sqlite(config.resolve(database))


async def connect_bridge(config: Config) -> SqliteBridgeLink | PostgresBridgeLink:
    """The bridge committer's own connection to the configured (already migrated) store."""
    database = config.server.database
    if is_postgres_url(database):
        async def connect() -> asyncpg.Connection:
            return await asyncpg.connect(
                database, server_settings=SESSION_SETTINGS, timeout=CONNECT_SECONDS
            )

        db = PostgresDatabase(await connect(), reconnect=connect)
        # the committer only enqueues; claims are taken by the delivery side's outbox
        return PostgresBridgeLink(
            db, PostgresOutbox(db, new_worker_id()), PostgresSeenRows(db), PostgresRelayState(db),
            PostgresUserLists(db),
            PostgresCatchupItems(db),
        )
    sqlite = await open_database(config.resolve(database))
    return SqliteBridgeLink(
        sqlite, Outbox(sqlite), SqliteSeenRows(sqlite), SqliteRelayState(sqlite),
        SqliteUserLists(sqlite),
        SqliteCatchupItems(sqlite),
    )
