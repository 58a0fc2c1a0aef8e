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

Exactly one deferred wakeup (issue 32): the committer stores the events a deferring rule
(`present`, `quiet`) held back from a pair inside the transaction that decided so (`defer`,
table `deferred_wakeups`, at most MAX_DEFERRED_PER_PAIR per pair and reason), and
`claim_deferred` deletes those now due (a quiet window's end passed; a presence lapsed by
time) and returns them, in a transaction that writes their outbox row (`enqueue_deferred`):
the committer judges them again (paused since, author muted since) and writes at most one row
per pair. A row is deleted only by that claim (or by the app ending its presence), and on
PostgreSQL the DELETE's row locks let only one worker's claim see a row, so each deferred
wakeup is enqueued once, whatever crashes or workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Generic, NamedTuple, TypeVar

from sigil_push.nostr.kinds import CONTACTS, MUTE_LIST
from sigil_push.store.records import Device

OWNERS_PER_READ = 32
"""Recipients whose lists one read fetches: at most 32 x 2 x 320 KB alive at once."""
F = TypeVar("F")
R = TypeVar("R")


class Listed(NamedTuple):
    """One pair's stored lists, as far as its owner has them (packed 32-byte keys,
    `pack_keys`): what the wake rules (`bridge.choices`) read to decide `muted` and
    `not_followed`."""

    private: bytes | None = None
    mute_keys: bytes | None = None
    mute_threads: bytes | None = None
    mute_words: tuple[str, ...] = ()
    follows: bytes | None = None


class AuthorCheck(NamedTuple, Generic[F]):
    """An event's facts (whatever the caller's rules read) and the devices of one recipient
    whose rules look at the stored lists."""

    facts: F
    devices: Sequence[Device]


Judge = Callable[[F, Device, Listed], R | None]
"""The caller's rules: what keeps `device` asleep for an event with these facts, given its
owner's lists (None: nothing)."""


class StoredList(NamedTuple):
    """A stored kind 10000 or 3 as the checks read it: its packed `p` keys and (kind 10000)
    its packed `e` ids (muted threads) and words."""

    keys: bytes
    threads: bytes = b""
    words: tuple[str, ...] = ()


Deferred = tuple[int, str, str, str, str | None, int | None, int]
"""A deferred wakeup row: (device id, reason, event id, relay, visible author or None,
due_at or None, created_at of the event)."""
MAX_DEFERRED_PER_PAIR = 32
"""Events kept per (pair, reason) for a deferred wakeup, newest first: one is pushed, the
others only stand in for it when its author was muted meanwhile."""


def _listed(
    device: Device, private: dict[int, bytes], lists: dict[tuple[str, int], StoredList]
) -> Listed:
    rules = device.rules
    if rules is None:
        return Listed()
    mute = lists.get((device.pubkey, MUTE_LIST)) if rules.mute_list else None
    follows = (
        lists.get((device.pubkey, CONTACTS))
        if rules.senders == "follows" and rules.follows_known else None
    )
    return Listed(
        private.get(device.id),
        None if mute is None else mute.keys,
        None if mute is None else mute.threads,
        () if mute is None else mute.words,
        None if follows is None else follows.keys,
    )


class UserList(NamedTuple):
    """A verified kind 10000 or 3, reduced to what is stored."""

    pubkey: str
    kind: int
    created_at: int
    event_id: str
    entries: bytes
    """`pack_keys` of its `p` tags (at most MAX_LIST_ENTRIES of them)."""
    entry_count: int
    """Its entries of every sort (`p`, `e`, `word`): a list with any is a mute list."""
    truncated: int
    """How many further tags were dropped past the caps."""
    threads: bytes = b""
    """A kind 10000's `e` tags (muted threads), packed like `entries`."""
    words: str = ""
    """A kind 10000's `word` tags, case-folded, newline-separated."""


class ListChecks(ABC):
    """The engine-free half of `UserListStore`: saving lists in key order through the engine's
    `_replace`, and the batch's kind 4 author checks, read through the engine's
    `_private_lists` and `_lists_of`."""

    async def save(self, lists: Sequence[UserList]) -> list[UserList]:
        """Store each list unless the stored one of its (npub, kind) is newer (NIP-01: newest
        `created_at`, then lowest id) or its npub has no device row (no pair, unregistered since
        it came, and no Iris subscription's target, whose rules read its lists too), in
        key order (workers overlapping on keys lock rows alike); returns those that replaced
        the stored one. In the caller's transaction, the `list_flags` of those npubs' pairs
        follow: only theirs (a list and its flags are written in one transaction, so a list
        seen again has nothing to mend; rewriting every owner's pairs for each unchanged list
        a relay re-sent made one registration rewrite a shard's pairs)."""
        taken = [item for item in sorted(lists) if await self._replace(item)]
        if taken:
            await self._flag_pairs(sorted({item.pubkey for item in taken}))
        return taken

    async def blocked(
        self, checks: Sequence[AuthorCheck[F]], judge: Judge[F, R]
    ) -> list[dict[int, R]]:
        """For each (event facts, devices of one recipient): which of those devices `judge`
        keeps asleep given their owners' lists, and why. The devices are those whose rules
        read lists (`bridge.choices`).

        A whole commit batch is answered together, OWNERS_PER_READ recipients at a time: per
        group, one read of the private mute lists of its devices that have one and one of the
        stored lists its npubs' rules use (`list_owners`), checked and dropped before the next group is read, so a batch of
        users with 10,000-key lists holds a few megabytes at most, however large the batch.
        """
        answers: list[dict[int, R]] = [{} for _ in checks]
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
                facts, asked = checks[index]
                found: dict[int, R] = {}
                for device in asked:
                    reason = judge(facts, device, _listed(device, private, lists))
                    if reason is not None:
                        found[device.id] = reason
                answers[index] = found
        return answers

    @abstractmethod
    async def _replace(self, item: UserList) -> bool:
        """Upsert `item` unless the stored list of its (npub, kind) is newer or the npub has
        no device row; whether it was stored."""

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
    ) -> dict[tuple[str, int], StoredList]:
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
