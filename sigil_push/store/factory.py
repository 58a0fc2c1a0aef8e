"""`open_store(config)`: the one place that knows which engine `server.database` names.

A path opens the SQLite file (created and migrated); a `postgresql://` URL opens an asyncpg
pool after applying `migrations/postgres/` under the advisory lock, so workers starting
together migrate once. The rest of the service receives a `Store` and never asks which.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

import aiosqlite
import asyncpg

from sigil_push.config import STOP_GRACE_SECONDS, Config, ConfigError, is_postgres_url
from sigil_push.identity import bridge_key, make_private
from sigil_push.store.auth_ids import UsedAuthIds
from sigil_push.store.interface import AuthIdStore, Database, DeviceStore, OutboxStore, Store
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.devices import PostgresDevices
from sigil_push.store.postgres.migrate import migrate_connection
from sigil_push.store.postgres.outbox import PostgresOutbox
from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.devices import Devices
from sigil_push.store.sqlite.outbox import Outbox

POOL_MAX = 10
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


INSTANCE_KEY = "instance_bridge_pubkey"


class ForeignBridgeKey(ConfigError):
    """This worker's bridge key is not the one the instance's other workers use."""

    def __init__(self) -> None:
        super().__init__(
            "server.secret_key_file",
            "this worker's bridge key differs from the one the instance already uses; every"
            " worker needs the same key (copy the first worker's key file, or set secret_key)",
        )


async def check_instance_key(db: PostgresDatabase, pubkey: str) -> None:
    """Every worker of an instance must share the bridge key: relays see one client key
    (NIP-42), and delegated-auth sessions are sealed under it, so a worker with another key
    would take them for unreadable. The first worker records the key's public half."""
    await db.run(
        "INSERT INTO meta (key, value) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        INSTANCE_KEY, pubkey,
    )
    if await db.fetchval("SELECT value FROM meta WHERE key = $1", INSTANCE_KEY) != pubkey:
        raise ForeignBridgeKey


async def preflight(config: Config) -> None:
    """Before a PostgreSQL worker starts listening: the database is reachable and migrated
    (under the lock), and this worker's bridge key is the instance's (one line, not a
    traceback, when either fails)."""
    connection = await asyncpg.connect(config.server.database)
    try:
        await migrate_connection(connection)
        db = PostgresDatabase(connection)
        key = await bridge_key(
            db, config.server.secret_key, config.resolve(config.server.secret_key_file)
        )
        await check_instance_key(db, key.public_key_hex)
    finally:
        await connection.close()


@dataclass
class BridgeLink:
    """`BridgeConnection`: the committer's own connection and an outbox writer on it."""

    db: Database
    outbox: OutboxStore

    async def close(self) -> None:
        await self.db.close()


@dataclass
class SqliteStore:
    """`Store` on one SQLite file."""

    path: Path
    db: aiosqlite.Connection
    devices: DeviceStore
    outbox: OutboxStore
    auth_ids: AuthIdStore
    engine: str = "sqlite"
    worker_id: str = field(default_factory=new_worker_id)

    async def close(self) -> None:
        await self.db.close()


@dataclass
class PostgresStore:
    """`Store` on a PostgreSQL database shared by any number of workers."""

    url: str
    db: PostgresDatabase
    pool: asyncpg.Pool
    devices: PostgresDevices
    outbox: OutboxStore
    auth_ids: AuthIdStore
    worker_id: str
    claim_ms: int
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
        url, min_size=1, max_size=POOL_MAX, server_settings=SESSION_SETTINGS
    )
    db = PostgresDatabase(pool)
    devices = PostgresDevices(db, worker_id)
    try:
        await devices.listen(url)
    except BaseException:
        await pool.close()
        raise
    return PostgresStore(
        url, db, pool, devices, PostgresOutbox(db, worker_id, claim_ms), UsedAuthIds(db),
        worker_id, claim_ms,
    )


async def open_sqlite(path: Path) -> SqliteStore:
    db = await open_database(path)
    make_private(path)
    return SqliteStore(path, db, Devices(db), Outbox(db), UsedAuthIds(db))


async def open_store(config: Config) -> Store:
    """The store `server.database` names, open and migrated."""
    database = config.server.database
    if is_postgres_url(database):
        return await open_postgres(database, new_worker_id(), claim_ms_for(config))
    return await open_sqlite(config.resolve(database))


async def connect_bridge(config: Config) -> BridgeLink:
    """The bridge committer's own connection to the configured (already migrated) store."""
    database = config.server.database
    if is_postgres_url(database):
        async def connect() -> asyncpg.Connection:
            return await asyncpg.connect(database, server_settings=SESSION_SETTINGS)

        db = PostgresDatabase(await connect(), reconnect=connect)
        # the committer only enqueues; claims are taken by the delivery side's outbox
        return BridgeLink(db, PostgresOutbox(db, new_worker_id()))
    sqlite = await open_database(config.resolve(database))
    return BridgeLink(sqlite, Outbox(sqlite))
