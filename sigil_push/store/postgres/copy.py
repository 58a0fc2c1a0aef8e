"""`sigil-push migrate --from FILE.db`: move an existing SQLite instance onto PostgreSQL.

Everything an instance remembers is copied: registrations (with their ids, which the outbox
refers to), the outbox (claims dropped, so wakeups in flight when the old instance stopped go
out again, under the same collapse ids since the collapse secret in `meta` comes along) with
the events its `event` and `sealed` wakeups carry (`outbox_events`, migration 0015), the
handled event ids, per-relay baselines and cursors, relay lists, delegated-auth sessions, learned
AUTH modes, NIP-98 ids and Iris subscriptions. The SQLite file is first brought to this build's
schema. Columns are matched by name, so a column only one side has is left to its default.

The bridge's own key is never copied: an old SQLite instance may still hold it in `meta`
(`bridge_secret_key`, from before keys moved to `server.secret_key_file`), and a database must
not carry the bridge's identity (sigil_push/identity.py). The count of such rows left behind is
reported under `BRIDGE_KEY_LEFT`, so the command can tell the operator where the key goes.

The target must hold no registrations and no outbox yet: copying into a live instance would
mix two instances' ids. The copy is one transaction: it lands whole or not at all.
"""

from __future__ import annotations

from pathlib import Path

import aiosqlite
import asyncpg

from sigil_push.store.postgres.migrate import migrate_connection
from sigil_push.store.records import BRIDGE_KEY_LEFT
from sigil_push.store.sqlite.database import open_database

TABLES = (
    "meta", "devices", "outbox", "outbox_events", "nip98_used", "seen_events", "seen_on_relay",
    "relay_baselines", "relay_cursors", "relay_lists", "auth_signers", "relay_auth_modes",
    "iris_subscriptions", "iris_targets",
)
_SERIAL = ("devices", "outbox")
BRIDGE_KEY_META = "bridge_secret_key"
"""identity.META_KEY; named here too so the store needs nothing from the service above it."""

_DROPPED = {"outbox": {"claimed_ms"}}


class TargetNotEmpty(Exception):
    """The PostgreSQL database already holds an instance's registrations or wakeups."""


async def copy_sqlite(source: Path, url: str) -> dict[str, int]:
    """Copy the instance in `source` into the (migrated, empty) database at `url`; returns the
    number of rows per table."""
    if not source.is_file():
        raise FileNotFoundError(f"no SQLite database at {source}")
    sqlite = await open_database(source)
    connection = await asyncpg.connect(url)
    try:
        await migrate_connection(connection)
        copied: dict[str, int] = {}
        async with connection.transaction():
            for table in _SERIAL:
                if await connection.fetchval(f"SELECT EXISTS (SELECT 1 FROM {table})"):
                    raise TargetNotEmpty(f"the PostgreSQL database already has {table} rows")
            await connection.execute("LOCK TABLE devices, outbox IN EXCLUSIVE MODE")
            for table in TABLES:
                copied[table] = await _copy_table(sqlite, connection, table)
            left = await sqlite.execute_fetchall(
                "SELECT 1 FROM meta WHERE key = ?", (BRIDGE_KEY_META,)
            )
            if left:
                copied[BRIDGE_KEY_LEFT] = len(list(left))
            for table in _SERIAL:
                await connection.execute(
                    f"SELECT setval(pg_get_serial_sequence('{table}', 'id'),"
                    f" GREATEST((SELECT max(id) FROM {table}), 1))"
                )
        return copied
    finally:
        await connection.close()
        await sqlite.close()


async def _copy_table(
    sqlite: aiosqlite.Connection, connection: asyncpg.Connection, table: str
) -> int:
    source_columns = [str(row[1]) for row in await sqlite.execute_fetchall(
        f"PRAGMA table_info({table})"
    )]
    target_columns = {
        str(row["column_name"]): str(row["data_type"]) for row in await connection.fetch(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = $1",
            table,
        )
    }
    columns = [
        c for c in source_columns if c in target_columns and c not in _DROPPED.get(table, set())
    ]
    where = " WHERE key <> ?" if table == "meta" else ""
    rows = [tuple(row) for row in await sqlite.execute_fetchall(
        f"SELECT {', '.join(columns)} FROM {table}{where}",
        (BRIDGE_KEY_META,) if where else (),
    )]
    flags = [i for i, c in enumerate(columns) if target_columns[c] == "boolean"]
    if flags:  # SQLite keeps a flag (outbox.has_event) as 0 or 1; asyncpg wants a bool
        rows = [
            tuple(bool(v) if i in flags and v is not None else v for i, v in enumerate(row))
            for row in rows
        ]
    if table == "meta" and rows:
        await connection.execute(
            "DELETE FROM meta WHERE key = ANY($1::text[])", [str(row[0]) for row in rows]
        )
    if rows:
        await connection.copy_records_to_table(table, records=rows, columns=columns)
    return len(rows)
