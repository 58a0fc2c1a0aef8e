"""What negentropy (NIP-77) reconciliation needs, kept in the store (both engines, one SQL):
which DMs each relay delivered, with their `created_at`, within the catch-up window
(migration 0010, `catchup_items`).

On reconnect the bridge offers a relay these (id, created_at) items for a shard's keys (all of
them on a firehose relay) and fetches only what the relay has beyond them; a row missing here
(a crash before the flush, a prune) only costs fetching that event again, which the seen ids
then drop, so the rows are written in bulk off the hot path and never inside the committer's
transaction. Rows older than the window are pruned, so the table stays bounded by it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sigil_push.store.interface import Database

UNADDRESSED = ""
"""The `pubkey` of a firehose relay's DM for nobody here: its id still spares a fetch."""
KEYS_PER_QUERY = 500


class CatchupItems:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def add(self, rows: Sequence[tuple[str, str, str, int]]) -> None:
        """(relay, pubkey, event_id, created_at) rows; a row already there is kept."""
        if rows:
            await self._db.executemany(
                "INSERT INTO catchup_items (relay, pubkey, event_id, created_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                rows,
            )

    async def items(
        self, relay: str, pubkeys: Sequence[str] | None, since: int
    ) -> dict[str, int]:
        """Event id → created_at of what `relay` delivered since `since`: for `pubkeys`, or
        every DM it delivered (firehose) when None."""
        found: dict[str, int] = {}
        if pubkeys is None:
            rows = await self._db.execute_fetchall(
                "SELECT event_id, created_at FROM catchup_items"
                " WHERE relay = ? AND created_at >= ?",
                (relay, since),
            )
            found.update((str(event_id), int(created_at)) for event_id, created_at in rows)
            return found
        keys = list(pubkeys)
        for start in range(0, len(keys), KEYS_PER_QUERY):
            chunk = keys[start : start + KEYS_PER_QUERY]
            marks = ",".join("?" * len(chunk))
            rows = await self._db.execute_fetchall(
                f"SELECT event_id, created_at FROM catchup_items WHERE relay = ?"
                f" AND created_at >= ? AND pubkey IN ({marks})",
                (relay, since, *chunk),
            )
            found.update((str(event_id), int(created_at)) for event_id, created_at in rows)
        return found

    async def prune(self, before: int) -> int:
        """Forget deliveries older than the window; how many rows went."""
        rows = await self._db.execute_fetchall(
            "SELECT COUNT(*) FROM catchup_items WHERE created_at < ?", (before,)
        )
        count = int(next(iter(rows))[0])
        if count:
            await self._db.execute("DELETE FROM catchup_items WHERE created_at < ?", (before,))
        return count
