"""SQLite databases as an earlier release left them, for tests of the migrations after it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sigil_push.store.sqlite.database import migration_files


def sqlite_at(path: Path, last_version: int) -> sqlite3.Connection:
    """A new SQLite file at `path` with migrations up to `last_version` applied and recorded
    as the service records them, open in autocommit mode for the test to add its rows (and
    to close)."""
    connection = sqlite3.connect(path, isolation_level=None)
    # as the service's runner does (store/sqlite/database.py): built in only from SQLite 3.41
    connection.create_function("unhex", 1, bytes.fromhex, deterministic=True)
    connection.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
        " applied_at INTEGER NOT NULL)"
    )
    for version, name, sql in migration_files():
        if version <= last_version:
            connection.executescript(
                f"BEGIN;\n{sql}\nINSERT INTO schema_migrations VALUES ({version}, '{name}', 0);"
                "\nCOMMIT;"
            )
    return connection
