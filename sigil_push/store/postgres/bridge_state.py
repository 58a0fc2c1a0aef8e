"""The bridge's rows on PostgreSQL: baselines, cursors, relay lists (`RelayStateStore`) and
handled event ids (`SeenRows`), in PostgreSQL's own SQL.

Many-row inserts are one statement over one array per column (`unnest`, in the rows' order);
updates, upserts and deletes run once per row in the order the caller sorted them (`many`), so
workers overlapping on keys during a hand-over take row locks in one global order and wait for
each other instead of deadlocking (tests/store/test_pg_commit_lock_order.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

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
from sigil_push.store.interface import BookkeepingOp, SeenRow
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.records import StoredRelayList, in_chunks

INSERT_BASELINES = (
    "INSERT INTO relay_baselines (relay, pubkey, baselined_at)"
    " SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) ON CONFLICT DO NOTHING"
)
_DELETES = {
    BookkeepingOp.DELETE_BASELINE: "DELETE FROM relay_baselines WHERE relay = $1 AND pubkey = $2",
    BookkeepingOp.DELETE_BASELINES_OF: "DELETE FROM relay_baselines WHERE pubkey = $1",
    BookkeepingOp.DELETE_RELAY_LISTS: "DELETE FROM relay_lists WHERE pubkey = $1",
    BookkeepingOp.DELETE_USER_LISTS: (
        "DELETE FROM user_lists WHERE pubkey = $1 AND NOT EXISTS"
        " (SELECT 1 FROM devices WHERE devices.pubkey = $1)"
    ),
}


def _marks(first: int, count: int) -> str:
    """`$first, ..., $(first + count - 1)`."""
    return ", ".join(f"${n}" for n in range(first, first + count))


def _columns(rows: Sequence[tuple[Any, ...]]) -> list[list[Any]]:
    """The rows as one list per column (the arrays of an `unnest` insert)."""
    return [list(column) for column in zip(*rows, strict=True)]


class PostgresRelayState:
    """`RelayStateStore` on a PostgreSQL handle."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def baseline_page(
        self, after: tuple[str, str], pairs: Sequence[str] | None, limit: int
    ) -> list[tuple[str, str]]:
        narrow = ""
        if pairs is not None:
            narrow = f" AND substr(pubkey, 7, 2) IN ({_marks(3, len(pairs))})"
        rows = await self._db.fetch(
            "SELECT relay, pubkey FROM relay_baselines WHERE (relay, pubkey) > ($1, $2)"
            f"{narrow} ORDER BY relay, pubkey LIMIT ${3 + len(pairs or ())}",
            *after, *(pairs or ()), limit,
        )
        return relay_pubkeys(rows)

    async def baselines_of_keys(self, pubkeys: Sequence[str]) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        for chunk in in_chunks(pubkeys):
            rows = await self._db.fetch(
                "SELECT relay, pubkey FROM relay_baselines WHERE pubkey IN"
                f" ({_marks(1, len(chunk))})",
                *chunk,
            )
            found.extend(relay_pubkeys(rows))
        return found

    async def cursors(self) -> dict[str, int]:
        rows = await self._db.fetch("SELECT relay, live_until FROM relay_cursors")
        return cursor_map(rows)

    async def save_cursors(self, cursors: Sequence[tuple[str, int]]) -> None:
        await self._db.many(
            "INSERT INTO relay_cursors (relay, live_until) VALUES ($1, $2)"
            " ON CONFLICT (relay) DO UPDATE SET live_until = excluded.live_until",
            cursors,
        )

    async def relay_lists(self) -> list[StoredRelayList]:
        rows = await self._db.fetch("SELECT pubkey, kind, created_at, relays FROM relay_lists")
        return decode_relay_lists(rows)

    async def save_relay_lists(self, lists: Sequence[StoredRelayList]) -> None:
        await self._db.many(
            "INSERT INTO relay_lists (pubkey, kind, created_at, relays) VALUES ($1, $2, $3, $4)"
            " ON CONFLICT (pubkey, kind) DO UPDATE SET created_at = excluded.created_at,"
            " relays = excluded.relays",
            encode_relay_lists(lists),
        )

    async def apply(self, op: BookkeepingOp, rows: Sequence[tuple[Any, ...]]) -> None:
        if not rows:
            return
        if op is BookkeepingOp.INSERT_BASELINES:
            await self._db.run(INSERT_BASELINES, *_columns(rows))
        else:
            await self._db.many(_DELETES[op], rows)


_LEGACY_ROW = "r.event_id = encode(e.event_id, 'hex')"
"""`seen_on_relay` (only read: written by releases before further relays were appended to
`seen_events` rows) keeps its ids as hex text."""
_WITH_LEGACY = ("e.event_id, e.relay, r.relay", f" LEFT JOIN seen_on_relay r ON {_LEGACY_ROW}")
_WITHOUT_LEGACY = ("e.event_id, e.relay, NULL", "")


class PostgresSeenRows:
    """`SeenRows` on a PostgreSQL handle."""

    sole_writer = False
    """Several workers write the rows (a shard's hand-over overlaps two of them)."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db
        self._legacy_rows = True
        """Until seen as empty: no release writes `seen_on_relay` any more, so it stays so."""

    async def _legacy_join(self) -> tuple[str, str]:
        """Columns and join reading legacy rows while there are any (each id's hex probed)."""
        if self._legacy_rows:
            found = await self._db.fetchval("SELECT 1 FROM seen_on_relay LIMIT 1")
            self._legacy_rows = found is not None
        return _WITH_LEGACY if self._legacy_rows else _WITHOUT_LEGACY

    async def recent(self, limit: int) -> list[SeenRow]:
        columns, join = await self._legacy_join()
        rows = await self._db.fetch(
            f"SELECT {columns} FROM (SELECT event_id, relay, keep_until FROM seen_events"
            f" ORDER BY keep_until DESC LIMIT $1) e{join} ORDER BY e.keep_until",
            limit,
        )
        return [seen_row(row) for row in rows]

    async def lookup(self, event_ids: Sequence[bytes]) -> list[SeenRow]:
        columns, join = await self._legacy_join()
        found: list[SeenRow] = []
        for chunk in in_chunks(event_ids):
            rows = await self._db.fetch(
                f"SELECT {columns} FROM seen_events e{join}"
                f" WHERE e.event_id IN ({_marks(1, len(chunk))})",
                *chunk,
            )
            found.extend(seen_row(row) for row in rows)
        return found

    async def insert(self, rows: Sequence[tuple[bytes, str, int]]) -> None:
        if rows:
            await self._db.run(
                "INSERT INTO seen_events (event_id, relay, keep_until)"
                " SELECT * FROM unnest($1::bytea[], $2::text[], $3::bigint[])"
                " ON CONFLICT DO NOTHING",
                *_columns(rows),
            )

    async def append_relays(self, rows: Sequence[tuple[str, bytes]]) -> None:
        await self._db.many(
            "UPDATE seen_events SET relay = relay || $1 WHERE event_id = $2", rows
        )

    async def prune(self, cutoff: int) -> int:
        removed = await self._db.run("DELETE FROM seen_events WHERE keep_until < $1", cutoff)
        await self._db.run("DELETE FROM seen_on_relay WHERE keep_until < $1", cutoff)
        return removed


class PostgresCatchupItems:
    """`CatchupItemsStore` on a PostgreSQL handle."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def add(self, rows: Sequence[tuple[str, str, str, int]]) -> None:
        if rows:
            await self._db.run(
                "INSERT INTO catchup_items AS kept (relays, pubkey, event_id, created_at,"
                " noted_at) SELECT * FROM unnest($1::text[], $2::bytea[], $3::bytea[],"
                " $4::bigint[], $5::bigint[]) ON CONFLICT (pubkey, event_id) DO UPDATE"
                " SET relays = (SELECT string_agg(relay, ' ' ORDER BY first) FROM"
                " (SELECT relay, min(n) AS first FROM unnest(string_to_array(kept.relays"
                " || ' ' || excluded.relays, ' ')) WITH ORDINALITY AS listed (relay, n)"
                " GROUP BY relay) AS once), noted_at = excluded.noted_at"
                " WHERE NOT string_to_array(excluded.relays, ' ')"
                " <@ string_to_array(kept.relays, ' ')",
                *_columns(merged_catchup_rows(rows, int(time.time() * 1000))),
            )

    async def items(
        self, relay: str, pubkeys: Sequence[str] | None, since: int
    ) -> dict[str, int]:
        return {event_id: at for _, event_id, at in await self.rows(relay, pubkeys, since)}

    async def rows(
        self, relay: str, pubkeys: Sequence[str] | None, since: int
    ) -> list[tuple[str, str, int]]:
        if pubkeys is None:
            rows = await self._db.fetch(
                "SELECT relays, pubkey, event_id, created_at FROM catchup_items"
                " WHERE created_at >= $1 AND strpos(' ' || relays || ' ', $2) > 0",
                since, listed(relay),
            )
        else:
            rows = await self._db.fetch(
                "SELECT relays, pubkey, event_id, created_at FROM catchup_items"
                " WHERE created_at >= $1 AND strpos(' ' || relays || ' ', $2) > 0"
                " AND pubkey = ANY($3::bytea[])",
                since, listed(relay), packed_keys(pubkeys),
            )
        return catchup_rows(rows, relay)

    async def noted_since(
        self, relay: str, noted_at: int, since: int
    ) -> list[tuple[str, str, int]]:
        rows = await self._db.fetch(
            "SELECT relays, pubkey, event_id, created_at FROM catchup_items"
            " WHERE noted_at >= $1 AND created_at >= $2 AND strpos(' ' || relays || ' ', $3) > 0",
            noted_at, since, listed(relay),
        )
        return catchup_rows(rows, relay)

    async def snapshot(self, relay: str, scope: str) -> list[tuple[int, int, bytes]]:
        rows = await self._db.fetch(
            "SELECT part, cut, data FROM catchup_snapshot_parts WHERE relay = $1 AND scope = $2"
            " ORDER BY part",
            relay, scope,
        )
        return [(int(row["part"]), int(row["cut"]), bytes(row["data"])) for row in rows]

    async def save_snapshot(
        self, relay: str, scope: str, cut: int, parts: Sequence[tuple[int, int, bytes]],
        drop: Sequence[int] = (), replace: bool = False,
    ) -> None:
        if replace:
            await self._db.run(
                "DELETE FROM catchup_snapshot_parts WHERE relay = $1 AND scope = $2", relay, scope
            )
        if drop:
            await self._db.run(
                "DELETE FROM catchup_snapshot_parts WHERE relay = $1 AND scope = $2"
                " AND part = ANY($3::int[])", relay, scope, list(drop),
            )
        for part, newest, data in parts:
            await self._db.run(
                "INSERT INTO catchup_snapshot_parts (relay, scope, part, cut, newest, data)"
                " VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (relay, scope, part) DO UPDATE SET"
                " cut = excluded.cut, newest = excluded.newest, data = excluded.data",
                relay, scope, part, cut, newest, data,
            )

    async def prune(self, cutoff: int) -> int:
        removed = await self._db.run("DELETE FROM catchup_items WHERE created_at < $1", cutoff)
        await self._db.run("DELETE FROM catchup_snapshot_parts WHERE newest < $1", cutoff)
        return removed
