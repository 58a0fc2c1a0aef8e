"""`UserListStore` on SQLite (see `store.preferences`): the users' kind 10000/3 lists, the
kind 4 author checks' reads, and the presence lapse marks and claims, on the bridge
committer's own connection.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiosqlite

from sigil_push.nostr.kinds import CONTACTS, MUTE_LIST
from sigil_push.store.preferences import ListChecks, UserList
from sigil_push.store.records import LIST_FLAGS


class SqliteUserLists(ListChecks):
    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def _replace(self, item: UserList) -> bool:
        rows = await self._db.execute_fetchall(
            "INSERT INTO user_lists (pubkey, kind, created_at, event_id, entries, entry_count,"
            " truncated) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (pubkey, kind) DO UPDATE SET"
            " created_at = excluded.created_at, event_id = excluded.event_id,"
            " entries = excluded.entries, entry_count = excluded.entry_count,"
            " truncated = excluded.truncated"
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
        rows = await self._db.execute_fetchall(
            f"SELECT id, muted FROM devices WHERE id IN ({','.join('?' * len(wanted))})"
            " AND muted IS NOT NULL",
            wanted,
        )
        return {int(device_id): bytes(muted) for device_id, muted in rows}

    async def _lists_of(
        self, muting: Sequence[str], following: Sequence[str]
    ) -> dict[tuple[str, int], bytes]:
        # a condition per kind asked for, each searched in the primary key (an empty
        # `IN ()` would make SQLite scan the table instead)
        wanted = [
            f"(kind = {kind} AND pubkey IN ({','.join('?' * len(owners))}))"
            for kind, owners in ((MUTE_LIST, muting), (CONTACTS, following))
            if owners
        ]
        rows = await self._db.execute_fetchall(
            f"SELECT pubkey, kind, entries FROM user_lists WHERE {' OR '.join(wanted)}",
            (*muting, *following),
        )
        return {(str(pubkey), int(kind)): bytes(entries) for pubkey, kind, entries in rows}

    async def mark_lapses(self, marks: Sequence[tuple[str, str, int]], now: int) -> None:
        """In the committer's transaction: (event id, relay, device id) of DMs a presence held
        back. A mark holds only while the presence does (not ended meanwhile)."""
        await self._db.executemany(
            "UPDATE devices SET lapse_event_id = ?, lapse_relay = ?"
            " WHERE id = ? AND present_until > ?",
            [(*mark, now) for mark in sorted(marks, key=lambda m: m[2])],
        )

    async def claim_lapses(self, now: int, now_ms: int) -> int:
        """In a transaction of the caller's: the presences that lapsed by `now` after holding
        a DM back, cleared, each with one outbox row (the last DM it held, due at once);
        returns how many.

        RETURNING gives the values after the update: the claim clears only `present_until`,
        which takes the row out of any later claim's reach, and returns the mark as it was;
        the mark is cleared next, in the same transaction."""
        rows = await self._db.execute_fetchall(
            "UPDATE devices SET present_until = NULL"
            " WHERE present_until <= ? AND lapse_event_id IS NOT NULL"
            " RETURNING id, lapse_event_id, lapse_relay",
            (now,),
        )
        wakeups = sorted((int(d), str(e), str(r), now_ms, now_ms) for d, e, r in rows)
        if wakeups:
            await self._db.executemany(
                "UPDATE devices SET lapse_event_id = NULL, lapse_relay = NULL WHERE id = ?",
                [(wakeup[0],) for wakeup in wakeups],
            )
            await self._db.executemany(
                "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
                " VALUES (?, ?, ?, ?, ?)",
                wakeups,
            )
        return len(wakeups)
