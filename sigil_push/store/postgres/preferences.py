"""`UserListStore` on PostgreSQL (see `store.preferences`): the users' kind 10000/3 lists, the
list checks' reads, and the deferred wakeups (presence lapses, quiet hours' ends), on the
bridge committer's own connection.

A deferred wakeup is claimed once across workers: the claiming DELETE row-locks each due row,
and a worker whose DELETE waited on that lock finds the row gone and skips it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sigil_push.nostr.kinds import CONTACTS, MUTE_LIST
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.preferences import (
    MAX_DEFERRED_PER_PAIR,
    Deferred,
    ListChecks,
    StoredList,
    UserList,
)
from sigil_push.store.records import LIST_FLAGS


class PostgresUserLists(ListChecks):
    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def _replace(self, item: UserList) -> bool:
        rows = await self._db.fetch(
            "INSERT INTO user_lists (pubkey, kind, created_at, event_id, entries, entry_count,"
            " truncated, threads, words) SELECT $1::text, $2::integer, $3::bigint, $4::text,"
            " $5::bytea, $6::integer, $7::integer, $8::bytea, $9::text"
            " WHERE EXISTS (SELECT 1 FROM devices WHERE devices.pubkey = $1::text)"
            " ON CONFLICT (pubkey, kind) DO UPDATE SET"
            " created_at = excluded.created_at, event_id = excluded.event_id,"
            " entries = excluded.entries, entry_count = excluded.entry_count,"
            " truncated = excluded.truncated, threads = excluded.threads,"
            " words = excluded.words"
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
    ) -> dict[tuple[str, int], StoredList]:
        rows = await self._db.fetch(
            "SELECT pubkey, kind, entries, threads, words FROM user_lists"
            f" WHERE (kind = {MUTE_LIST} AND pubkey = ANY($1::text[]))"
            f" OR (kind = {CONTACTS} AND pubkey = ANY($2::text[]))",
            muting, following,
        )
        return {
            (str(row[0]), int(row[1])): StoredList(
                bytes(row[2]), bytes(row[3]), tuple(str(row[4]).split("\n")) if row[4] else ()
            )
            for row in rows
        }

    async def defer(self, rows: Sequence[Deferred], now: int) -> None:
        """In the committer's transaction, in (device, reason, event) order (the lock order of
        workers that overlap during a hand-over); as on SQLite, a presence's row holds only
        while the presence does, and each (pair, reason) keeps its newest events."""
        ordered = sorted(rows, key=lambda row: (row[0], row[1], row[2]))
        await self._db.run(
            "INSERT INTO deferred_wakeups (device_id, reason, event_id, relay, author, due_at,"
            " created_at) SELECT u.d, u.r, u.e, u.rl, u.a, u.due, u.c"
            " FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[],"
            " $6::bigint[], $7::bigint[]) AS u (d, r, e, rl, a, due, c)"
            " WHERE u.r <> 'present' OR EXISTS (SELECT 1 FROM devices"
            " WHERE id = u.d AND present_until > $8)"
            " ON CONFLICT (device_id, reason, event_id) DO NOTHING",
            *([row[i] for row in ordered] for i in range(7)), now,
        )
        pairs = sorted({(row[0], row[1]) for row in ordered})
        await self._db.run(
            "DELETE FROM deferred_wakeups w USING unnest($1::bigint[], $2::text[]) AS p (d, r)"
            " WHERE w.device_id = p.d AND w.reason = p.r AND w.event_id NOT IN"
            " (SELECT event_id FROM deferred_wakeups WHERE device_id = p.d AND reason = p.r"
            f" ORDER BY created_at DESC, event_id LIMIT {MAX_DEFERRED_PER_PAIR})",
            [p[0] for p in pairs], [p[1] for p in pairs],
        )

    async def claim_deferred(self, now: int) -> list[Deferred]:
        """In a transaction of the caller's: the deferred events now due, deleted (row locks:
        one worker's claim each); the lapsed presences are cleared."""
        lapsed = await self._db.fetch(
            "UPDATE devices SET present_until = NULL WHERE present_until <= $1"
            " AND id IN (SELECT device_id FROM deferred_wakeups WHERE reason = 'present')"
            " RETURNING id",
            now,
        )
        rows = list(await self._db.fetch(
            "DELETE FROM deferred_wakeups WHERE (reason <> 'present' AND due_at <= $1)"
            " OR (reason = 'present' AND device_id = ANY($2::bigint[]))"
            " RETURNING device_id, reason, event_id, relay, author, due_at, created_at",
            now, sorted(int(row[0]) for row in lapsed),
        ))
        return sorted(
            (int(r[0]), str(r[1]), str(r[2]), str(r[3]), None if r[4] is None else str(r[4]),
             None if r[5] is None else int(r[5]), int(r[6]))
            for r in rows
        )

    async def enqueue_deferred(self, wakeups: Sequence[tuple[int, str, str]], now_ms: int) -> None:
        """One outbox row per (device id, event id, relay), due at once."""
        ordered = sorted(wakeups)
        await self._db.run(
            "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
            " SELECT d, e, r, $4, $4 FROM unnest($1::bigint[], $2::text[], $3::text[])"
            " AS u (d, e, r) ON CONFLICT (device_id, event_id) DO NOTHING",
            [w[0] for w in ordered], [w[1] for w in ordered], [w[2] for w in ordered], now_ms,
        )
