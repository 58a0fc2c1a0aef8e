"""What the bridge reads and writes of the users' choices (issue 20): each npub's newest kind
10000 mute list and kind 3 contact list, the kind 4 author checks against them and against a
pair's private mute list, and the presence lapse wakeups.

The SQL is the same on both engines (portable `?` SQL on the `Database` handle, as `seen.py`),
and all of it runs on the bridge committer's own connection. Lists are stored, not held in
memory: a list is one row whose keys are packed 32 bytes each, sorted (`pack_keys`), replaced
whole by one UPSERT that only a newer list wins, and read only for a kind 4 to a pair whose
rules need it (`Rules.checks_author`).

Exactly one lapse wakeup: the committer marks a pair whose presence held a DM back inside the
transaction that decided so (`mark_lapses`), and `claim_lapses` clears the marks of lapsed
presences and writes their outbox rows in one transaction. A mark is cleared only by that
claim (or by the app ending its presence), and on PostgreSQL the UPDATE's row locks let only
one worker's claim see a mark, so each lapse is enqueued once, whatever crashes or workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sigil_push.store.interface import Database
from sigil_push.store.records import CONTACTS_KIND, MUTE_LIST_KIND, Device, has_key

MUTED = "muted"
NOT_FOLLOWED = "not_followed"
OWNERS_PER_READ = 32
"""Recipients whose lists one read fetches: at most 32 x 2 x 320 KB alive at once."""
AuthorCheck = tuple[str, Sequence[Device]]
"""A kind 4's author and the devices of one recipient whose rules look at authors."""


def _reasons(
    author: bytes,
    devices: Sequence[Device],
    private: dict[int, bytes],
    lists: dict[tuple[str, int], bytes],
) -> dict[int, str]:
    reasons: dict[int, str] = {}
    for device in devices:
        rules = device.rules
        if rules is None:
            continue
        muted = private.get(device.id)
        mute_list = lists.get((device.pubkey, MUTE_LIST_KIND)) if rules.mute_list else None
        if (muted is not None and has_key(muted, author)) or (
            mute_list is not None and has_key(mute_list, author)
        ):
            reasons[device.id] = MUTED
            continue
        if rules.senders == "follows" and rules.follows_known:
            follows = lists.get((device.pubkey, CONTACTS_KIND))
            if follows is not None and not has_key(follows, author):
                reasons[device.id] = NOT_FOLLOWED
    return reasons


class UserList(NamedTuple):
    """A verified kind 10000 or 3, reduced to what is stored."""

    pubkey: str
    kind: int
    created_at: int
    event_id: str
    entries: bytes
    """`pack_keys` of its `p` tags (at most MAX_LIST_ENTRIES of them)."""
    entry_count: int
    truncated: int
    """How many further `p` tags were dropped past the cap."""


class UserLists:
    """`UserListStore` on the committer's connection (either engine)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def save(self, lists: Sequence[UserList]) -> list[UserList]:
        """Store each list unless the stored one of its (npub, kind) is newer (NIP-01: newest
        `created_at`, then lowest id); returns those that replaced the stored one."""
        taken: list[UserList] = []
        for item in sorted(lists):  # key order: workers overlapping on keys lock alike
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
            if rows:
                taken.append(item)
        return taken

    async def blocked(self, checks: Sequence[AuthorCheck]) -> list[dict[int, str]]:
        """For each (author, devices of one recipient): which of those devices a kind 4 by
        that author must not wake, and why (`muted` before `not_followed`). The devices are
        those whose rules check authors (`Rules.checks_author`).

        A whole commit batch is answered together, OWNERS_PER_READ recipients at a time: per
        group, one read of the private mute lists of its devices that have one and one of its
        npubs' stored lists, checked and dropped before the next group is read, so a batch of
        users with 10,000-key lists holds a few megabytes at most, however large the batch.
        """
        answers: list[dict[int, str]] = [{} for _ in checks]
        by_owner: dict[str, list[int]] = {}
        for index, (_, devices) in enumerate(checks):
            if devices:
                by_owner.setdefault(devices[0].pubkey, []).append(index)
        owners = sorted(by_owner)
        for start in range(0, len(owners), OWNERS_PER_READ):
            group = owners[start : start + OWNERS_PER_READ]
            indexes = [i for owner in group for i in by_owner[owner]]
            devices = [d for i in indexes for d in checks[i][1]]
            private = await self._private_lists(devices)
            lists = await self._lists_of(devices)
            for index in indexes:
                author, asked = checks[index]
                answers[index] = _reasons(bytes.fromhex(author), asked, private, lists)
        return answers

    async def _private_lists(self, devices: Sequence[Device]) -> dict[int, bytes]:
        wanted = sorted({d.id for d in devices if d.rules is not None and d.rules.muted_count})
        if not wanted:
            return {}
        return {
            int(device_id): bytes(muted)
            for device_id, muted in await self._db.execute_fetchall(
                f"SELECT id, muted FROM devices WHERE id IN ({','.join('?' * len(wanted))})"
                " AND muted IS NOT NULL",
                wanted,
            )
        }

    async def _lists_of(self, devices: Sequence[Device]) -> dict[tuple[str, int], bytes]:
        owners = sorted({d.pubkey for d in devices if d.rules is not None
                         and (d.rules.mute_list or d.rules.follows_known)})
        if not owners:
            return {}
        return {
            (str(pubkey), int(kind)): bytes(entries)
            for pubkey, kind, entries in await self._db.execute_fetchall(
                "SELECT pubkey, kind, entries FROM user_lists"
                f" WHERE pubkey IN ({','.join('?' * len(owners))})",
                owners,
            )
        }

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
        returns how many."""
        # RETURNING gives the values after the update (on SQLite): the claim clears only
        # `present_until`, which takes the row out of the claim's reach, and returns the mark
        # as it was; the mark is cleared next, in the same transaction
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
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                wakeups,
            )
        return len(wakeups)
