"""What the bridge reads and writes of the users' choices (issue 20): each npub's newest kind
10000 mute list and kind 3 contact list, the kind 4 author checks against them and against a
pair's private mute list, and the presence lapse wakeups.

Here is what the engines share (the stored form, the batch's author checks); each engine's SQL
is in `store/sqlite/preferences.py` and `store/postgres/preferences.py`, and all of it runs on
the bridge committer's own connection (`BridgeConnection.lists`). Lists are stored, not held in
memory: a list is one row whose keys are packed 32 bytes each, sorted (`pack_keys`), replaced
whole by one UPSERT that only a newer list wins, and read only for a kind 4 to a pair whose
rules need it (`Rules.checks_author`). Which lists an npub has is copied onto its pairs' rows
(`devices.list_flags`, migration 0011) when a list or a pair is written: the device read of
every DM, the ingest's hot path, then reads one row and no other table.

Exactly one lapse wakeup: the committer marks a pair whose presence held a DM back inside the
transaction that decided so (`mark_lapses`), and `claim_lapses` clears the marks of lapsed
presences and writes their outbox rows in one transaction. A mark is cleared only by that
claim (or by the app ending its presence), and on PostgreSQL the UPDATE's row locks let only
one worker's claim see a mark, so each lapse is enqueued once, whatever crashes or workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from sigil_push.nostr.kinds import CONTACTS, MUTE_LIST
from sigil_push.store.records import Device, has_key

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
        mute_list = lists.get((device.pubkey, MUTE_LIST)) if rules.mute_list else None
        if (muted is not None and has_key(muted, author)) or (
            mute_list is not None and has_key(mute_list, author)
        ):
            reasons[device.id] = MUTED
            continue
        if rules.senders == "follows" and rules.follows_known:
            follows = lists.get((device.pubkey, CONTACTS))
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


class ListChecks(ABC):
    """The engine-free half of `UserListStore`: saving lists in key order through the engine's
    `_replace`, and the batch's kind 4 author checks, read through the engine's
    `_private_lists` and `_lists_of`."""

    async def save(self, lists: Sequence[UserList]) -> list[UserList]:
        """Store each list unless the stored one of its (npub, kind) is newer (NIP-01: newest
        `created_at`, then lowest id), in key order (workers overlapping on keys lock rows
        alike); returns those that replaced the stored one. In the caller's transaction, the
        `list_flags` of the npubs' pairs follow (those of every list seen, not only the new
        ones: a list seen again mends flags a crash left behind)."""
        taken = [item for item in sorted(lists) if await self._replace(item)]
        await self._flag_pairs(sorted({item.pubkey for item in lists}))
        return taken

    async def blocked(self, checks: Sequence[AuthorCheck]) -> list[dict[int, str]]:
        """For each (author, devices of one recipient): which of those devices a kind 4 by
        that author must not wake, and why (`muted` before `not_followed`). The devices are
        those whose rules check authors (`Rules.checks_author`).

        A whole commit batch is answered together, OWNERS_PER_READ recipients at a time: per
        group, one read of the private mute lists of its devices that have one and one of the
        stored lists its npubs' rules use (`list_owners`), checked and dropped before the next group is read, so a batch of
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
            wanted = with_private_lists(devices)
            private = await self._private_lists(wanted) if wanted else {}
            muting, following = list_owners(devices)
            lists = await self._lists_of(muting, following) if muting or following else {}
            for index in indexes:
                author, asked = checks[index]
                answers[index] = _reasons(bytes.fromhex(author), asked, private, lists)
        return answers

    @abstractmethod
    async def _replace(self, item: UserList) -> bool:
        """Upsert `item` unless the stored list of its (npub, kind) is newer; whether it
        was stored."""

    @abstractmethod
    async def _flag_pairs(self, owners: Sequence[str]) -> None:
        """Set `devices.list_flags` of every pair of the (sorted) `owners` from their stored
        lists (`LIST_FLAGS`), so that the device read of every DM asks no other table."""

    @abstractmethod
    async def _private_lists(self, device_ids: Sequence[int]) -> dict[int, bytes]:
        """Device id -> packed private mute list, of those (non-empty) `device_ids` that
        have one (`with_private_lists`)."""

    @abstractmethod
    async def _lists_of(
        self, muting: Sequence[str], following: Sequence[str]
    ) -> dict[tuple[str, int], bytes]:
        """(npub, kind) -> packed keys of the stored kind 10000 of the `muting` npubs and
        kind 3 of the `following` ones (`list_owners`; not both empty)."""


def with_private_lists(devices: Sequence[Device]) -> list[int]:
    """Ids of the `devices` whose rules say they have a private mute list, sorted."""
    return sorted({d.id for d in devices if d.rules is not None and d.rules.muted_count})


def list_owners(devices: Sequence[Device]) -> tuple[list[str], list[str]]:
    """The npubs of the `devices` whose rules use their stored kind 10000, and those whose
    rules use their kind 3 (follows-only), each sorted. A kind 3 is read only for
    follows-only: most users have one, often of thousands of keys, and a user who mutes but
    takes DMs from anyone must not have it read with every DM."""
    muting: set[str] = set()
    following: set[str] = set()
    for device in devices:
        rules = device.rules
        if rules is None:
            continue
        if rules.mute_list:
            muting.add(device.pubkey)
        if rules.senders == "follows" and rules.follows_known:
            following.add(device.pubkey)
    return sorted(muting), sorted(following)
