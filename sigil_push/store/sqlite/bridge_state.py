"""The bridge's rows on SQLite: baselines, cursors, relay lists (`RelayStateStore`), handled
event ids (`SeenRows`), and the committer's unit of work (`transaction`).

All of it runs on the committer's own connection (`store.factory.connect_bridge`), so one
transaction holds a batch's outbox rows, seen ids and the bookkeeping queued behind them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiosqlite

from sigil_push.store.bridge_rows import (
    catchup_rows,
    cursor_map,
    decode_relay_lists,
    encode_relay_lists,
    listed,
    merged_catchup_rows,
    packed_keys,
    relay_pubkeys,
    seen_row,
)
from sigil_push.store.errors import TRANSIENT_ERRORS
from sigil_push.store.interface import BookkeepingOp, SeenRow
from sigil_push.store.records import StoredRelayList, in_chunks

BOOKKEEPING_SQL = {
    BookkeepingOp.INSERT_BASELINES: (
        "INSERT INTO relay_baselines (relay, pubkey, baselined_at) VALUES (?, ?, ?)"
        " ON CONFLICT DO NOTHING"
    ),
    BookkeepingOp.DELETE_BASELINE: "DELETE FROM relay_baselines WHERE relay = ? AND pubkey = ?",
    BookkeepingOp.DELETE_BASELINES_OF: "DELETE FROM relay_baselines WHERE pubkey = ?",
    BookkeepingOp.DELETE_RELAY_LISTS: "DELETE FROM relay_lists WHERE pubkey = ?",
    BookkeepingOp.DELETE_USER_LISTS: (
        "DELETE FROM user_lists WHERE pubkey = ?1 AND NOT EXISTS"
        " (SELECT 1 FROM devices WHERE devices.pubkey = ?1)"
    ),
}


@contextlib.asynccontextmanager
async def transaction(db: aiosqlite.Connection) -> AsyncIterator[None]:
    """`BEGIN IMMEDIATE` (the write lock up front: no upgrade deadlock with the API's writes)
    ... `COMMIT`, or a rollback on any exception (itself allowed to fail on a broken file).

    A cancelled `await` leaves its statement to run on aiosqlite's thread all the same: a
    `BEGIN` cancelled while it waits for another connection's lock opens its transaction later,
    and a cancelled `COMMIT` still commits. So the rollback covers the `BEGIN` too, and is
    sqlite3's own, which is queued behind them and does nothing when no transaction is open
    (an explicit `ROLLBACK` would fail then, hiding the cancellation). An open transaction
    left behind would fail every later `BEGIN` on the connection, a fault no retry mends
    (tests/store/test_sqlite_transaction.py)."""
    try:
        await db.execute("BEGIN IMMEDIATE")
        yield
        await db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await db.rollback()
        raise


class SqliteRelayState:
    """`RelayStateStore` on one aiosqlite connection."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def baseline_page(
        self, after: tuple[str, str], pairs: Sequence[str] | None, limit: int
    ) -> list[tuple[str, str]]:
        narrow = ""
        if pairs is not None:
            narrow = f" AND substr(pubkey, 7, 2) IN ({', '.join('?' * len(pairs))})"
        rows = await self._db.execute_fetchall(
            "SELECT relay, pubkey FROM relay_baselines WHERE (relay, pubkey) > (?, ?)"
            f"{narrow} ORDER BY relay, pubkey LIMIT ?",
            (*after, *(pairs or ()), limit),
        )
        return relay_pubkeys(rows)

    async def baselines_of_keys(self, pubkeys: Sequence[str]) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        for chunk in in_chunks(pubkeys):
            rows = await self._db.execute_fetchall(
                f"SELECT relay, pubkey FROM relay_baselines WHERE pubkey IN"
                f" ({', '.join('?' * len(chunk))})",
                chunk,
            )
            found.extend(relay_pubkeys(rows))
        return found

    async def cursors(self) -> dict[str, int]:
        rows = await self._db.execute_fetchall("SELECT relay, live_until FROM relay_cursors")
        return cursor_map(rows)

    async def save_cursors(self, cursors: Sequence[tuple[str, int]]) -> None:
        await self._db.executemany(
            "INSERT INTO relay_cursors (relay, live_until) VALUES (?, ?)"
            " ON CONFLICT (relay) DO UPDATE SET live_until = excluded.live_until",
            cursors,
        )

    async def relay_lists(self) -> list[StoredRelayList]:
        rows = await self._db.execute_fetchall(
            "SELECT pubkey, kind, created_at, relays FROM relay_lists"
        )
        return decode_relay_lists(rows)

    async def save_relay_lists(self, lists: Sequence[StoredRelayList]) -> None:
        await self._db.executemany(
            "INSERT INTO relay_lists (pubkey, kind, created_at, relays) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (pubkey, kind) DO UPDATE SET created_at = excluded.created_at,"
            " relays = excluded.relays",
            encode_relay_lists(lists),
        )

    async def apply(self, op: BookkeepingOp, rows: Sequence[tuple[Any, ...]]) -> None:
        await self._db.executemany(BOOKKEEPING_SQL[op], rows)


_LEGACY_ROW = "r.event_id = lower(hex(e.event_id))"
"""`seen_on_relay` (only read: written by releases before further relays were appended to
`seen_events` rows) keeps its ids as hex text."""
_WITH_LEGACY = ("e.event_id, e.relay, r.relay", f" LEFT JOIN seen_on_relay r ON {_LEGACY_ROW}")
_WITHOUT_LEGACY = ("e.event_id, e.relay, NULL", "")


class SqliteSeenRows:
    """`SeenRows` on one aiosqlite connection: a rowid table in arrival order with the ids'
    32 bytes under a unique index (migrations/0014_seen_ids_in_arrival_order.sql: an insert
    dirties the pages at the ends of the table and the expiry index, not random ones)."""

    sole_writer = True
    """One process owns the file (store/sqlite/coordination.py)."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db
        self._legacy_rows = True
        """Until seen as empty: nothing writes `seen_on_relay` any more, so it stays so."""

    async def _legacy_join(self) -> tuple[str, str]:
        """Columns and join reading legacy rows while there are any: probing each id's hex
        there was most of the start-up seen-cache load."""
        if self._legacy_rows:
            found = await self._db.execute_fetchall("SELECT 1 FROM seen_on_relay LIMIT 1")
            self._legacy_rows = bool(found)
        return _WITH_LEGACY if self._legacy_rows else _WITHOUT_LEGACY

    async def recent(self, limit: int) -> list[SeenRow]:
        columns, join = await self._legacy_join()
        rows = await self._db.execute_fetchall(
            f"SELECT {columns} FROM (SELECT event_id, relay, keep_until"
            f" FROM seen_events ORDER BY keep_until DESC LIMIT ?) e{join} ORDER BY e.keep_until",
            (limit,),
        )
        return [seen_row(row) for row in rows]

    async def lookup(self, event_ids: Sequence[bytes]) -> list[SeenRow]:
        columns, join = await self._legacy_join()
        found: list[SeenRow] = []
        for chunk in in_chunks(event_ids):
            rows = await self._db.execute_fetchall(
                f"SELECT {columns} FROM seen_events e{join}"
                f" WHERE e.event_id IN ({','.join('?' * len(chunk))})",
                chunk,
            )
            found.extend(seen_row(row) for row in rows)
        return found

    async def insert(self, rows: Sequence[tuple[bytes, str, int]]) -> None:
        await self._db.executemany(
            "INSERT INTO seen_events (event_id, relay, keep_until) VALUES (?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            rows,
        )

    async def append_relays(self, rows: Sequence[tuple[str, bytes]]) -> None:
        await self._db.executemany(
            "UPDATE seen_events SET relay = relay || ? WHERE event_id = ?", rows
        )

    async def prune(self, cutoff: int) -> int:
        cursor = await self._db.execute("DELETE FROM seen_events WHERE keep_until < ?", (cutoff,))
        removed = int(cursor.rowcount)
        await cursor.close()
        await self._db.execute("DELETE FROM seen_on_relay WHERE keep_until < ?", (cutoff,))
        return removed


CATCHUP_KEYS_PER_QUERY = 500


class SqliteCatchupItems:
    """`CatchupItemsStore` on one aiosqlite connection (writes inside the caller's
    transaction). A rowid table in arrival order with the ids as bytes under the unique
    index (migration 0014), one row per DM and recipient listing its relays (0016): rows
    append, only that index takes random inserts."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def add(self, rows: Sequence[tuple[str, str, str, int]]) -> None:
        await self._db.executemany(
            "INSERT INTO catchup_items (relays, pubkey, event_id, created_at, noted_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (pubkey, event_id) DO UPDATE"
            " SET relays = relays_union(relays, excluded.relays), noted_at = excluded.noted_at"
            " WHERE relays_union(relays, excluded.relays) != relays",
            merged_catchup_rows(rows, int(time.time() * 1000)),
        )

    async def items(
        self, relay: str, pubkeys: Sequence[str] | None, since: int
    ) -> dict[str, int]:
        """The (event id → created_at) view of `rows`: one chunked query serves both."""
        return {event_id: at for _, event_id, at in await self.rows(relay, pubkeys, since)}

    async def rows(
        self, relay: str, pubkeys: Sequence[str] | None, since: int
    ) -> list[tuple[str, str, int]]:
        if pubkeys is None:
            rows = await self._db.execute_fetchall(
                "SELECT relays, pubkey, event_id, created_at FROM catchup_items"
                " WHERE created_at >= ? AND instr(' ' || relays || ' ', ?) > 0",
                (since, listed(relay)),
            )
            return catchup_rows(rows, relay)
        found: list[tuple[str, str, int]] = []
        for start in range(0, len(pubkeys), CATCHUP_KEYS_PER_QUERY):
            chunk = list(pubkeys[start : start + CATCHUP_KEYS_PER_QUERY])
            rows = await self._db.execute_fetchall(
                "SELECT relays, pubkey, event_id, created_at FROM catchup_items"
                " WHERE created_at >= ? AND instr(' ' || relays || ' ', ?) > 0"
                f" AND pubkey IN ({','.join('?' * len(chunk))})",
                (since, listed(relay), *packed_keys(chunk)),
            )
            found.extend(catchup_rows(rows, relay))
        return found

    async def noted_since(
        self, relay: str, noted_at: int, since: int
    ) -> list[tuple[str, str, int]]:
        rows = await self._db.execute_fetchall(
            "SELECT relays, pubkey, event_id, created_at FROM catchup_items"
            " WHERE noted_at >= ? AND created_at >= ? AND instr(' ' || relays || ' ', ?) > 0",
            (noted_at, since, listed(relay)),
        )
        return catchup_rows(rows, relay)

    async def snapshot(self, relay: str, scope: str) -> list[tuple[int, int, bytes]]:
        rows = await self._db.execute_fetchall(
            "SELECT part, cut, data FROM catchup_snapshot_parts WHERE relay = ? AND scope = ?"
            " ORDER BY part",
            (relay, scope),
        )
        return [(int(row[0]), int(row[1]), bytes(row[2])) for row in rows]

    async def save_snapshot(
        self, relay: str, scope: str, cut: int, parts: Sequence[tuple[int, int, bytes]],
        drop: Sequence[int] = (), replace: bool = False,
    ) -> None:
        if replace:
            await self._db.execute(
                "DELETE FROM catchup_snapshot_parts WHERE relay = ? AND scope = ?", (relay, scope)
            )
        await self._db.executemany(
            "DELETE FROM catchup_snapshot_parts WHERE relay = ? AND scope = ? AND part = ?",
            [(relay, scope, part) for part in drop],
        )
        await self._db.executemany(
            "INSERT INTO catchup_snapshot_parts (relay, scope, part, cut, newest, data)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (relay, scope, part) DO UPDATE SET"
            " cut = excluded.cut, newest = excluded.newest, data = excluded.data",
            [(relay, scope, part, cut, newest, data) for part, newest, data in parts],
        )

    async def prune(self, cutoff: int) -> int:
        cursor = await self._db.execute(
            "DELETE FROM catchup_items WHERE created_at < ?", (cutoff,)
        )
        removed = int(cursor.rowcount)
        await cursor.close()
        await self._db.execute("DELETE FROM catchup_snapshot_parts WHERE newest < ?", (cutoff,))
        return removed
