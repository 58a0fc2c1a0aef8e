"""The SQLite database: one aiosqlite connection in WAL mode, migrated at start-up.

Migrations are the numbered `.sql` files of `migrations/`, applied in order inside a
transaction each and recorded in `schema_migrations`; an applied file is never re-run, so a
migration must never be edited once released (add a new one instead).
"""

from __future__ import annotations

import logging
import os
import time
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import aiosqlite

from sigil_push.store.bridge_rows import relays_union

log = logging.getLogger(__name__)


class MigrationError(Exception):
    """The database is at a schema version this code does not know, or a migration failed."""


def _migrations_folder() -> Traversable:
    """The checkout's `migrations/` when running from source, else the installed copy."""
    source_tree = Path(__file__).resolve().parents[3] / "migrations"
    if source_tree.is_dir():
        return source_tree
    return resources.files("sigil_push.migrations")


def migration_files() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every migration, sorted by version."""
    found = []
    for entry in _migrations_folder().iterdir():
        name = entry.name
        if name.endswith(".sql") and name[:4].isdigit():
            found.append((int(name[:4]), name, entry.read_text(encoding="utf-8")))
    return sorted(found)


def _unhex(text: str) -> bytes:
    """SQLite's `unhex` (built in only from 3.41), for the migrations that store hex ids as
    bytes (0014). A malformed id fails the migration, which then changes nothing."""
    return bytes.fromhex(text)


async def _apply_migrations(connection: aiosqlite.Connection) -> list[str]:
    await connection.create_function("unhex", 1, _unhex, deterministic=True)
    await connection.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations"
        " (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)"
    )
    async with connection.execute("SELECT version FROM schema_migrations") as cursor:
        applied = {row[0] for row in await cursor.fetchall()}
    known = migration_files()
    unknown = applied - {version for version, _, _ in known}
    if unknown:
        raise MigrationError(
            f"database has migrations {sorted(unknown)} unknown to this version of sigil-push"
        )
    newly_applied = []
    for version, name, sql in known:
        if version in applied:
            continue
        try:
            await connection.executescript(
                f"BEGIN;\n{sql}\nINSERT INTO schema_migrations VALUES"
                f" ({version}, '{name}', {int(time.time())});\nCOMMIT;"
            )
        except Exception as exc:
            await connection.rollback()
            raise MigrationError(f"migration {name} failed: {exc}") from exc
        log.info("applied migration %s", name)
        newly_applied.append(name)
    return newly_applied


ORDINARY_SECURE_DELETE = "FAST"
"""How ordinary deletes (outbox rows, seen ids) clear their bytes: zeroed inside the b-tree
pages the delete writes anyway, but a page left empty goes to the free list unwritten. SQLite's
default depends on its build (Debian's is ON), and ON writes every page a delete frees: a sealed
wakeup's outbox row carries its ~2 KB event, so a whole page per row or two, which was most of
what settling a sealed push cost over an opaque one (bench/push.py --sealed, issue 21). The one
secret that must leave no trace uses `SqliteMeta.delete_securely` (ON for that statement)."""


async def open_database(path: Path) -> aiosqlite.Connection:
    """Open (creating if needed) and migrate the database at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = await aiosqlite.connect(path, isolation_level=None)
    try:
        await connection.execute("PRAGMA journal_mode=WAL")
        await connection.execute("PRAGMA synchronous=NORMAL")
        await connection.execute("PRAGMA foreign_keys=ON")
        await connection.execute("PRAGMA busy_timeout=5000")
        await connection.execute(f"PRAGMA secure_delete={ORDINARY_SECURE_DELETE}")
        await _apply_migrations(connection)
        await connection.create_function(
            "relays_union", 2, relays_union, deterministic=True
        )
    except BaseException:
        await connection.close()
        raise
    return connection


async def migrate(path: Path) -> list[str]:
    """Apply pending migrations and close; returns the names applied."""
    path.parent.mkdir(parents=True, exist_ok=True)
    async with aiosqlite.connect(path, isolation_level=None) as connection:
        await connection.execute("PRAGMA journal_mode=WAL")
        return await _apply_migrations(connection)


def make_private(database: Path) -> None:
    """Tighten an existing database (and its WAL/SHM) to 0600: files created before the
    process umask was 077 (`http/server.py`) kept whatever umask made them."""
    for path in (database, database.with_name(database.name + "-wal"),
                 database.with_name(database.name + "-shm")):
        try:
            os.chmod(path, 0o600)
        except FileNotFoundError:
            continue
