"""Apply `migrations/postgres/NNNN_*.sql` to a PostgreSQL database, once each, under a lock.

Several workers may start at the same moment; a session-level advisory lock makes them take
turns, and the `schema_migrations` table records each applied version, so nothing runs twice.
A database that already carries a version this build does not know was migrated by a newer
release: it is refused rather than run against a schema this code does not understand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import asyncpg

# An arbitrary constant shared by every sigil-push worker: the advisory-lock key for migrations.
MIGRATION_LOCK_KEY = 0x5167_11_0001
_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


class MigrationError(Exception):
    """The database's schema cannot be brought to this build's version."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def _folder() -> Traversable:
    """The checkout's `migrations/postgres/` when running from source, else the installed copy."""
    source_tree = Path(__file__).resolve().parents[3] / "migrations" / "postgres"
    if source_tree.is_dir():
        return source_tree
    return resources.files("sigil_push.migrations").joinpath("postgres")


def available() -> list[Migration]:
    """The packaged PostgreSQL migrations, in version order (numbers must be unique)."""
    folder = _folder()
    found: dict[int, Migration] = {}
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if not match:
            continue
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"two PostgreSQL migrations numbered {version:04d}")
        found[version] = Migration(version, entry.name, entry.read_text(encoding="utf-8"))
    return [found[version] for version in sorted(found)]


async def migrate_connection(
    connection: asyncpg.Connection, migrations: list[Migration] | None = None
) -> list[str]:
    """Apply what is missing on this connection; returns the names applied (maybe none)."""
    wanted = available() if migrations is None else migrations
    await connection.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
    try:
        await connection.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
            " applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        rows = await connection.fetch("SELECT version FROM schema_migrations")
        applied = {int(row["version"]) for row in rows}
        known = {migration.version for migration in wanted}
        unknown = sorted(applied - known)
        if unknown:
            raise MigrationError(
                f"database has migration {unknown[-1]:04d}, newer than this build knows"
                f" (up to {max(known, default=0):04d}); upgrade sigil-push"
            )
        done: list[str] = []
        for migration in wanted:
            if migration.version in applied:
                continue
            async with connection.transaction():
                await connection.execute(migration.sql)
                await connection.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                    migration.version,
                    migration.name,
                )
            done.append(migration.name)
        return done
    finally:
        await connection.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)


async def migrate(url: str) -> list[str]:
    """Connect to `url`, apply the missing migrations, and close."""
    connection = await asyncpg.connect(url)
    try:
        return await migrate_connection(connection)
    finally:
        await connection.close()
