"""`UserListStore` on PostgreSQL (see `store.preferences`): the users' kind 10000/3 lists, the
kind 4 author checks' reads, and the presence lapse marks and claims, on the bridge
committer's own connection.

A lapse is claimed once across workers: the claiming UPDATE row-locks each lapsed pair, and a
worker whose UPDATE waited on that lock re-checks the row (`present_until` is NULL by then)
and skips it. PostgreSQL's RETURNING gives the new values, so, as on SQLite, the claim clears
`present_until` first and the mark after reading it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sigil_push.nostr.kinds import CONTACTS, MUTE_LIST
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.preferences import ListChecks, UserList
from sigil_push.store.records import LIST_FLAGS


class PostgresUserLists(ListChecks):
    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def _replace(self, item: UserList) -> bool:
        rows = await self._db.fetch(
            "INSERT INTO user_lists (pubkey, kind, created_at, event_id, entries, entry_count,"
            " truncated) VALUES ($1, $2, $3, $4, $5, $6, $7)"
            " ON CONFLICT (pubkey, kind) DO UPDATE SET"
            " created_at = excluded.created_at, event_id = excluded.event_id,"
            " entries = excluded.entries, entry_count = excluded.entry_count,"
            " truncated = excluded.truncated"
            " WHERE excluded.created_at > user_lists.created_at"
            " OR (excluded.created_at = user_lists.created_at"
            " AND excluded.event_id < user_lists.event_id)"
            " RETURNING kind",
            *item,
        )
        return bool(rows)

    async def _flag_pairs(self, owners: Sequence[str]) -> None:
        """Under each npub's advisory lock, which a registration holds while it reads the
        lists into its new pair's `list_flags` (`PostgresDevices.register`): whichever of the
        two takes it second sees what the other committed, so no pair misses both."""
        await self._db.run(
            "SELECT pg_advisory_xact_lock(hashtext(p)) FROM unnest($1::text[]) AS p ORDER BY p",
            owners,
        )
        await self._db.run(
            f"UPDATE devices SET list_flags = {LIST_FLAGS.format(pubkey='devices.pubkey')}"
            " WHERE pubkey = ANY($1::text[])",
            owners,
        )

    async def _private_lists(self, wanted: Sequence[int]) -> dict[int, bytes]:
        rows = await self._db.fetch(
            "SELECT id, muted FROM devices WHERE id = ANY($1::bigint[]) AND muted IS NOT NULL",
            wanted,
        )
        return {int(row[0]): bytes(row[1]) for row in rows}

    async def _lists_of(
        self, muting: Sequence[str], following: Sequence[str]
    ) -> dict[tuple[str, int], bytes]:
        rows = await self._db.fetch(
            "SELECT pubkey, kind, entries FROM user_lists"
            f" WHERE (kind = {MUTE_LIST} AND pubkey = ANY($1::text[]))"
            f" OR (kind = {CONTACTS} AND pubkey = ANY($2::text[]))",
            muting, following,
        )
        return {(str(row[0]), int(row[1])): bytes(row[2]) for row in rows}

    async def mark_lapses(self, marks: Sequence[tuple[str, str, int]], now: int) -> None:
        """In the committer's transaction, devices in id order (the lock order of workers
        that overlap during a hand-over)."""
        ordered = sorted(marks, key=lambda m: m[2])
        await self._db.run(
            "UPDATE devices d SET lapse_event_id = m.e, lapse_relay = m.r"
            " FROM unnest($1::text[], $2::text[], $3::bigint[]) AS m (e, r, id)"
            " WHERE d.id = m.id AND d.present_until > $4",
            [m[0] for m in ordered], [m[1] for m in ordered], [m[2] for m in ordered], now,
        )

    async def claim_lapses(self, now: int, now_ms: int) -> int:
        """In a transaction of the caller's: lapsed presences that held a DM back, cleared,
        each with one outbox row due at once; returns how many."""
        rows = await self._db.fetch(
            "UPDATE devices SET present_until = NULL"
            " WHERE present_until <= $1 AND lapse_event_id IS NOT NULL"
            " RETURNING id, lapse_event_id, lapse_relay",
            now,
        )
        if not rows:
            return 0
        ids = [int(row[0]) for row in rows]
        await self._db.run(
            "UPDATE devices SET lapse_event_id = NULL, lapse_relay = NULL"
            " WHERE id = ANY($1::bigint[])",
            ids,
        )
        await self._db.run(
            "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
            " SELECT d, e, r, $4, $4 FROM unnest($1::bigint[], $2::text[], $3::text[])"
            " AS u (d, e, r) ON CONFLICT (device_id, event_id) DO NOTHING",
            ids, [str(row[1]) for row in rows], [str(row[2]) for row in rows], now_ms,
        )
        return len(rows)
