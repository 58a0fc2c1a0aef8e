"""`UserListStore` on SQLite (see `store.preferences`): the users' kind 10000/3 lists, the
list checks' reads, and the deferred wakeups (presence lapses, quiet hours' ends), on the
bridge committer's own connection.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiosqlite

from sigil_push.nostr.kinds import CONTACTS, MUTE_LIST
from sigil_push.store.preferences import (
    MAX_DEFERRED_PER_PAIR,
    Deferred,
    ListChecks,
    StoredList,
    UserList,
)
from sigil_push.store.records import LIST_FLAGS, in_chunks


class SqliteUserLists(ListChecks):
    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def _replace(self, item: UserList) -> bool:
        rows = await self._db.execute_fetchall(
            "INSERT INTO user_lists (pubkey, kind, created_at, event_id, entries, entry_count,"
            " truncated, threads, words) SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9"
            " WHERE EXISTS (SELECT 1 FROM devices WHERE devices.pubkey = ?1)"
            " ON CONFLICT (pubkey, kind) DO UPDATE SET"
            " created_at = excluded.created_at, event_id = excluded.event_id,"
            " entries = excluded.entries, entry_count = excluded.entry_count,"
            " truncated = excluded.truncated, threads = excluded.threads,"
            " words = excluded.words"
            " WHERE excluded.created_at > user_lists.created_at"
            " OR (excluded.created_at = user_lists.created_at"
            " AND excluded.event_id < user_lists.event_id)"
            " RETURNING kind",
            tuple(item),
        )
        return bool(rows)

    async def _flag_pairs(self, owners: Sequence[str]) -> None:
        """SQLite writes one transaction at a time: a pair registered meanwhile is written
        before this (and set here) or after it (and reads the lists stored here)."""
        await self._db.executemany(
            f"UPDATE devices SET list_flags = {LIST_FLAGS.format(pubkey='?1')} WHERE pubkey = ?1",
            [(owner,) for owner in owners],
        )

    async def _private_lists(self, wanted: Sequence[int]) -> dict[int, bytes]:
        found: dict[int, bytes] = {}
        for chunk in in_chunks(wanted):
            rows = await self._db.execute_fetchall(
                f"SELECT id, muted FROM devices WHERE id IN ({','.join('?' * len(chunk))})"
                " AND muted IS NOT NULL",
                chunk,
            )
            found.update((int(device_id), bytes(muted)) for device_id, muted in rows)
        return found

    async def _lists_of(
        self, muting: Sequence[str], following: Sequence[str]
    ) -> dict[tuple[str, int], StoredList]:
        # a condition per kind asked for, each searched in the primary key (an empty
        # `IN ()` would make SQLite scan the table instead)
        wanted = [
            f"(kind = {kind} AND pubkey IN ({','.join('?' * len(owners))}))"
            for kind, owners in ((MUTE_LIST, muting), (CONTACTS, following))
            if owners
        ]
        rows = await self._db.execute_fetchall(
            f"SELECT pubkey, kind, entries, threads, words FROM user_lists"
            f" WHERE {' OR '.join(wanted)}",
            (*muting, *following),
        )
        return {
            (str(pubkey), int(kind)): StoredList(
                bytes(entries), bytes(threads), tuple(str(words).split("\n")) if words else ()
            )
            for pubkey, kind, entries, threads, words in rows
        }

    async def defer(self, rows: Sequence[Deferred], now: int) -> None:
        """In the committer's transaction: events a deferring rule held back. A presence's
        row holds only while the presence does (not ended meanwhile); each (pair, reason)
        keeps its MAX_DEFERRED_PER_PAIR newest events."""
        ordered = sorted(rows, key=lambda row: (row[0], row[1], row[2]))
        await self._db.executemany(
            "INSERT INTO deferred_wakeups (device_id, reason, event_id, relay, author, due_at,"
            " created_at) SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7"
            " WHERE ?2 != 'present' OR EXISTS (SELECT 1 FROM devices"
            " WHERE id = ?1 AND present_until > ?8)"
            " ON CONFLICT (device_id, reason, event_id) DO NOTHING",
            [(*row, now) for row in ordered],
        )
        await self._db.executemany(
            "DELETE FROM deferred_wakeups WHERE device_id = ?1 AND reason = ?2 AND event_id NOT IN"
            " (SELECT event_id FROM deferred_wakeups WHERE device_id = ?1 AND reason = ?2"
            f" ORDER BY created_at DESC, event_id LIMIT {MAX_DEFERRED_PER_PAIR})",
            sorted({(row[0], row[1]) for row in ordered}),
        )

    async def claim_deferred(self, now: int) -> list[Deferred]:
        """In a transaction of the caller's: the deferred events now due (a quiet window's end
        passed, a presence lapsed by time), deleted; the lapsed presences are cleared."""
        lapsed = await self._db.execute_fetchall(
            "UPDATE devices SET present_until = NULL WHERE present_until <= ?"
            " AND id IN (SELECT device_id FROM deferred_wakeups WHERE reason = 'present')"
            " RETURNING id",
            (now,),
        )
        ids = [int(row[0]) for row in lapsed]
        rows = list(await self._db.execute_fetchall(
            "DELETE FROM deferred_wakeups WHERE reason != 'present' AND due_at <= ?"
            " RETURNING device_id, reason, event_id, relay, author, due_at, created_at",
            (now,),
        ))
        if ids:
            rows.extend(await self._db.execute_fetchall(
                "DELETE FROM deferred_wakeups WHERE reason = 'present'"
                f" AND device_id IN ({','.join('?' * len(ids))})"
                " RETURNING device_id, reason, event_id, relay, author, due_at, created_at",
                ids,
            ))
        return sorted(
            (int(d), str(r), str(e), str(rl), None if a is None else str(a),
             None if due is None else int(due), int(c))
            for d, r, e, rl, a, due, c in rows
        )

    async def enqueue_deferred(self, wakeups: Sequence[tuple[int, str, str]], now_ms: int) -> None:
        """One outbox row per (device id, event id, relay), due at once (SQLite's outbox has
        no (device, event) key: a held event was never handed to the outbox for its pair)."""
        await self._db.executemany(
            "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
            " VALUES (?, ?, ?, ?, ?)",
            [(*wakeup, now_ms, now_ms) for wakeup in sorted(wakeups)],
        )
