"""Key sharding and the first-subscription baseline for one relay.

Keys are packed into shards (one REQ each) that stay stable: adding or removing a key changes
exactly one shard, so only that shard is re-requested and the others keep streaming.

Every REQ gets a fresh subscription id (`<shard>.<generation>`), so frames of a replaced REQ
can be told apart from frames of its successor. A key is "fresh" on a relay until the relay
has sent EOSE for a REQ that included it: what the relay returns before that EOSE predates the
registration and is remembered as seen, not pushed (CONTRACT section 5).

Beyond DMs (issue 32), each REQ also asks for the public kinds its keys' pairs want (`wants`,
the key registry's map of each key's extra kinds: mentions, reposts, reactions, zaps): one more
filter, `{"kinds": K, "#p": keys}` with K the union of the shard's keys' kinds (on a firehose,
of every key's on the relay), reaching back only `stale_after` (a public event older than that
is not pushed anyway). Catch-up pages that filter like the DM ones (its own cursor, its own
`since`), and NIP-77 reconciles it as a part of its own (`reconcile_target`).

A relay in firehose mode has one REQ for every DM (`{"kinds": [4, 1059]}`, no `#p`) whatever
the number of keys: adding or removing a key sends nothing, and the relay learns nothing about
who is registered. Keys join the baseline as soon as that REQ is past EOSE (events stored
before its EOSE are checked against the recipient's registration time instead, by the bridge).
Switching mode sends the new REQs before closing the old ones, from the relay's cursor, so the
switch loses nothing and de-duplication absorbs the overlap.

On a configured relay each shard's REQ also asks for its keys' lists (kinds 10050, 10002 and
10000, and kind 3 only of the keys with a follows-only pair): a key's whole lists only in the
first REQ that names it (`lists_new`, until that REQ's EOSE), the others' only from the relay's
cursor (`lists_since`). Re-requesting a shard because one key joined it must not bring back
every other key's lists, a kind 3 of 200 KB each. A key that turns follows-only has its whole
kind 3 asked for so too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from sigil_push.nostr.kinds import CONTACTS, DM_KINDS
from sigil_push.relays.discovery import SUBSCRIBED_LIST_KINDS, UNFILTERED_LIST_KINDS
from sigil_push.relays.nip11 import RelayLimits

KEY_BYTES_IN_FILTER = 67  # 64 hex digits, two quotes, one comma
REQ_OVERHEAD_BYTES = 512
MAX_PAGES_PER_CATCHUP = 1_000
"""Pages one shard's catch-up may ask for (500,000 events at a relay's usual 500 a page);
past it the shard stops paging, says so (`take_capped`) and counts as caught up."""
FETCH_BATCH = 500
"""Ids per REQ when fetching what negentropy found missing (strfry's max filter limit)."""
PAGES_IN_FLIGHT = 4
"""Page REQs open at once on one relay (1 when it publishes `max_subscriptions`: the spare
subscription is the only room); other shards' pages wait their turn."""


@dataclass(slots=True)
class Shard:
    index: int
    keys: set[str] = field(default_factory=set)
    dirty: bool = True
    sub_id: str | None = None


@dataclass(slots=True)
class PageCursor:
    """Where one DM filter of a catch-up stands: its kinds, the `until` its latest page asked
    with (None: the live REQ itself), how many events that page added, and the oldest
    `created_at` so far with the ids seen at exactly that second.

    The ids at the oldest second are what makes paging exact: `until` is inclusive, so the
    next page returns them again, and an event is new only if it is older than `until` or at
    `until` and not among them. A page that adds nothing new ends the filter's catch-up."""

    kinds: tuple[int, ...]
    until: int | None = None
    added: int = 0
    oldest: int | None = None
    at_oldest: set[str] = field(default_factory=set)
    boundary: frozenset[str] = frozenset()
    since: int | None = None
    """The filter's own `since`, later than its REQ's (public kinds: `stale_after` back)."""

    def count(self, event_id: str, created_at: int) -> None:
        if self.until is not None and (
            created_at > self.until or (created_at == self.until and event_id in self.boundary)
        ):
            return
        self.added += 1
        if self.oldest is None or created_at < self.oldest:
            self.oldest = created_at
            self.at_oldest = {event_id}
        elif created_at == self.oldest:
            self.at_oldest.add(event_id)

    def wants_more(self, since: int) -> bool:
        since = since if self.since is None else max(since, self.since)
        return self.added > 0 and self.oldest is not None and self.oldest > since

    def next_page(self) -> None:
        """Ask next from the oldest second so far, its ids already counted."""
        self.until = self.oldest
        self.boundary = frozenset(self.at_oldest)
        self.added = 0


@dataclass(slots=True)
class SentReq:
    """A REQ as it was sent (which shard, which of its keys were fresh then) and, until its
    EOSE, where each of its DM filters stands (`PageCursor`); a page carries its chain's
    cursors on, with the number of pages asked so far."""

    sub_id: str
    shard: int
    fresh: frozenset[str]
    keys: list[str]
    since: int
    cursors: list[PageCursor]
    page: int = 0
    method: str = "req"
    ids: list[str] | None = None
    """A fetch of the ids negentropy found missing, instead of a window."""
    lists_new: frozenset[str] = frozenset()
    """Keys whose whole lists this REQ asked for (known once it reaches EOSE)."""

    def count(self, event_id: str, kind: int, created_at: int) -> bool:
        """Count the event towards the filter of its kind; False when no filter asks it."""
        for cursor in self.cursors:
            if kind in cursor.kinds:
                cursor.count(event_id, created_at)
                return True
        return False


@dataclass(frozen=True, slots=True)
class Request:
    """What the caller must send to bring one shard up to date."""

    close: str | None
    sub_id: str | None
    filters: list[dict[str, Any]]
    fresh: bool
    page: bool = False
    reconcile: bool = False
    """The REQ asks for live events only (`limit` 0): the window is caught up by negentropy."""


NO_KINDS: frozenset[int] = frozenset()


class RelaySubscriptions:
    def __init__(
        self,
        keys_per_filter: int,
        with_lists: bool,
        baselined: set[str] | None = None,
        wants: Mapping[str, frozenset[int]] | None = None,
        stale_after: int = 3600,
        follows: set[str] | None = None,
    ) -> None:
        """`wants`: each key's public kinds (keys that want DMs only are absent), kept by the
        key registry; `stale_after`: how far back the public kinds' filter reaches;
        `follows`: the keys with a follows-only pair, whose kind 3 is asked for (the pool's
        one set, shared by every relay and kept current through `contacts_changed`)."""
        self._wants: Mapping[str, frozenset[int]] = wants if wants is not None else {}
        self._stale_after = stale_after
        self._key_kinds: dict[str, frozenset[int]] = {}
        """The public kinds of each key here that has some, as last taken from `wants`."""
        self._kind_keys: dict[int, int] = {}
        """How many keys here want each public kind (the firehose's filter)."""
        self._asked: dict[int, frozenset[int]] = {}
        """Per shard, the public kinds its last REQ asked for."""
        self._keys_per_filter = max(1, keys_per_filter)
        self._capacity = self._keys_per_filter
        self.with_lists = with_lists
        self.baselined: set[str] = baselined if baselined is not None else set()
        self.follows: set[str] = follows if follows is not None else set()
        self.lists_new: set[str] = set()
        """Keys whose whole lists no REQ here has brought yet (most keys: none; not a set of
        every key, which cost each key a slot per relay)."""
        self.contacts_new: set[str] = set()
        """Keys that turned follows-only, whose whole kind 3 is still to come."""
        self._lists_since: int | None = None
        self.shard_of: dict[str, int] = {}
        self.shards: list[Shard] = []
        # no shard before this index has room: adding a key costs O(1), not a scan of every
        # shard (1M keys at 500 per shard made start-up quadratic)
        self._first_with_room = 0
        self._pending: dict[str, SentReq] = {}
        self._generation = 0
        self._max_filters: int | None = None
        self._max_limit: int | None = None
        self._refused: set[int] = set()
        self._max_shards: int | None = None
        self._length_cap = 1 << 30
        self.overflow: set[str] = set()
        self.firehose = False
        self._retired: list[str] = []
        self._newly_baselined: set[str] = set()
        self._pages_waiting: list[SentReq] = []
        self._pages_in_flight: set[str] = set()
        self._capped = 0
        self.fetched = {"req": 0, "negentropy": 0}
        """Stored DMs returned before an EOSE, by catch-up method, for metrics."""
        self.finished = {"req": 0}
        """Paged catch-ups (a REQ and all its pages) finished, for metrics."""
        self.negentropy = False
        """Whether to try NIP-77 for shards whose keys are all baselined (set by the pool)."""
        self._reconciling: dict[int, tuple[str, int]] = {}
        self.watch_pages: Collection[str] = frozenset()
        """The relay's watch catch-up pages in flight (`RelayWatches.pages`, set by the pool):
        they answer with stored events too (`answering`), counted there."""

    @property
    def keys(self) -> dict[str, int]:
        return self.shard_of

    def add(self, key: str, new: bool = True) -> None:
        """Put a key into the first shard with room; past the relay's subscription limit, a
        shard grows up to the message size limit, and beyond that the key waits unsubscribed.
        A `new` key's whole lists are asked for (a key moved between shards keeps its state)."""
        if key in self.shard_of or key in self.overflow:
            return
        self._take_kinds(key)
        if new and self.with_lists and not self.firehose:
            self.lists_new.add(key)
        if self.firehose:
            self.shard_of[key] = 0
            if self._firehose_live() and key not in self.baselined:
                # its events arrive live from now on; older ones come only in a later REQ's
                # stored answer, where the bridge checks them against the registration time
                # (a key that came with a stored baseline, from another worker, has one)
                self.baselined.add(key)
                self._newly_baselined.add(key)
            return
        shard = self._shard_with_room()
        if shard is None:
            self.overflow.add(key)
            return
        shard.keys.add(key)
        shard.dirty = True
        self.shard_of[key] = shard.index

    def _shard_with_room(self) -> Shard | None:
        for index in range(self._first_with_room, len(self.shards)):
            if len(self.shards[index].keys) < self._capacity:
                self._first_with_room = index
                return self.shards[index]
        self._first_with_room = len(self.shards)
        if self._max_shards is None or len(self.shards) < self._max_shards:
            shard = Shard(len(self.shards))
            self.shards.append(shard)
            return shard
        if self._capacity < self._length_cap:
            self._capacity = min(self._length_cap, self._capacity + max(1, self._capacity // 2))
            self._first_with_room = 0
            return self._shard_with_room()
        return None

    def _take_kinds(self, key: str) -> bool:
        """Take `key`'s public kinds from `wants`; whether they changed."""
        kinds = self._wants.get(key, NO_KINDS)
        before = self._key_kinds.get(key, NO_KINDS)
        if kinds == before:
            return False
        counts = self._kind_keys
        for kind in before:
            counts[kind] -= 1
            if not counts[kind]:
                del counts[kind]
        for kind in kinds:
            counts[kind] = counts.get(kind, 0) + 1
        if kinds:
            self._key_kinds[key] = kinds
        else:
            del self._key_kinds[key]
        return True

    def touch(self, key: str) -> bool:
        """The key's wanted kinds may have changed: re-request its shard (True) when it now
        wants a kind its shard's REQ does not ask for. A kind no longer wanted is left asked
        (ingest drops what nobody wants before any signature check)."""
        if not self._take_kinds(key):
            return False
        index = self.shard_of.get(key)
        if index is None or index >= len(self.shards):
            return False
        wanted = self._kind_keys.keys() if self.firehose else self._key_kinds.get(key, NO_KINDS)
        if not set(wanted) <= self._asked.get(index, NO_KINDS):
            self.shards[index].dirty = True
            return True
        return False

    def _wants_gone(self, key: str) -> None:
        counts = self._kind_keys
        for kind in self._key_kinds.pop(key):
            counts[kind] -= 1
            if not counts[kind]:
                del counts[kind]

    def _public_kinds(self, shard: Shard) -> tuple[int, ...]:
        """The public kinds a shard's REQ asks for: those of its keys (a firehose: every
        key's on the relay)."""
        if self.firehose:
            return tuple(sorted(self._kind_keys))
        kinds: set[int] = set()
        wanting = self._key_kinds
        if wanting:
            for key in shard.keys:
                found = wanting.get(key)
                if found is not None:
                    kinds |= found
        return tuple(sorted(kinds))

    def remove(self, key: str) -> None:
        self.overflow.discard(key)
        if key in self._key_kinds:
            self._wants_gone(key)
        index = self.shard_of.pop(key, None)
        self.baselined.discard(key)
        self._newly_baselined.discard(key)
        self.lists_new.discard(key)
        self.contacts_new.discard(key)
        if index is not None and not self.firehose:
            shard = self.shards[index]
            shard.keys.discard(key)
            shard.dirty = True
            self._first_with_room = min(self._first_with_room, index)
            if self.overflow:
                self.add(self.overflow.pop(), new=False)

    def apply_limits(self, limits: RelayLimits) -> None:
        """Fit shards to a relay's NIP-11 limits; re-packs every shard if the capacity changes.

        One subscription is kept spare for a replacement REQ or a page in flight.
        """
        self._max_filters = limits.max_filters
        self._max_limit = limits.max_limit
        per_key = KEY_BYTES_IN_FILTER * (3 if self.with_lists else 2)
        if limits.max_message_length:
            self._length_cap = max(1, (limits.max_message_length - REQ_OVERHEAD_BYTES) // per_key)
        capacity = max(1, min(self._keys_per_filter, self._length_cap))
        if limits.max_subscriptions:
            self._max_shards = max(1, limits.max_subscriptions - 1)
            wanted = len(self.shard_of) + len(self.overflow)
            capacity = max(capacity, min(self._length_cap, math.ceil(wanted / self._max_shards)))
        if self.firehose or (capacity == self._capacity and not self.overflow):
            self._capacity = capacity
            self._first_with_room = 0
            return
        self._capacity = capacity
        self._first_with_room = 0
        keys = [*self.shard_of, *self.overflow]
        old_subs = [shard.sub_id for shard in self.shards if shard.sub_id]
        self.shard_of.clear()
        self.overflow.clear()
        self.shards = [Shard(i, sub_id=None) for i in range(len(old_subs))]
        for key in keys:
            self.add(key, new=False)
        for shard, sub_id in zip(self.shards, old_subs):
            shard.sub_id = sub_id

    def set_firehose(self, firehose: bool) -> bool:
        """Switch mode; True if it changed. The old REQs are retired: `due` closes them only
        after the new ones are sent, and the new ones reach back to the relay's cursor."""
        if firehose == self.firehose:
            return False
        self.firehose = firehose
        retired = [shard.sub_id for shard in self.shards if shard.sub_id]
        for sub_id in retired:
            self._pending.pop(sub_id, None)
        self._retired.extend(retired)
        self._refused.clear()
        keys = [*self.shard_of, *self.overflow]
        self.shard_of.clear()
        self.overflow.clear()
        self.shards = [Shard(0)] if firehose else []
        self._first_with_room = 0
        if firehose:  # its REQ names no key: lists come from its window only
            self.lists_new.clear()
            self.contacts_new.clear()
        for key in keys:
            self.add(key, new=False)
        return True

    def contacts_changed(self, key: str, follows: bool) -> bool:
        """`key` got (or lost) a follows-only pair: its shard's REQ names it in the kind 3
        filters (its whole kind 3 first) or no longer. True when there is a REQ to send."""
        if not self.with_lists or self.firehose or key not in self.shard_of:
            return False  # a firehose asks for every kind 3 of its window anyway
        if follows:
            self.contacts_new.add(key)
        else:
            self.contacts_new.discard(key)
        self.shards[self.shard_of[key]].dirty = True
        return True

    def take_newly_baselined(self) -> frozenset[str]:
        """Keys that joined a live firehose since the last call (to be stored as baselined)."""
        newly, self._newly_baselined = frozenset(self._newly_baselined), set()
        return newly

    def _firehose_live(self) -> bool:
        shard = self.shards[0] if self.shards else None
        return (
            shard is not None
            and shard.sub_id is not None
            and not shard.dirty
            and shard.sub_id not in self._pending
        )

    def connection_lost(self) -> None:
        """The relay forgot every subscription: each shard must be requested again."""
        self._pending.clear()
        self._refused.clear()
        self._retired.clear()
        self._pages_waiting.clear()
        self._pages_in_flight.clear()
        self._reconciling.clear()
        for shard in self.shards:
            shard.dirty = True
            shard.sub_id = None

    def refresh(self) -> None:
        """Re-request every shard (after AUTH), closing the previous REQs."""
        for shard in self.shards:
            shard.dirty = True

    def due(
        self, since_full: int, since_caught_up: int, lists_since: int | None = None
    ) -> list[Request]:
        """Requests for every changed shard; marks them clean.

        A shard with fresh keys asks for the whole catch-up window (its pre-EOSE answer is the
        baseline); one whose keys are all baselined may ask from the relay's cursor. Its lists:
        the new keys' whole lists, the others' from `lists_since` (None: all, as before).
        """
        self._lists_since = lists_since
        requests = []
        for shard in self.shards:
            if not shard.dirty:
                continue
            shard.dirty = False
            self._refused.discard(shard.index)
            if self._pages_waiting:
                # the new REQ starts its own catch-up: the old one's next pages are moot
                self._pages_waiting = [p for p in self._pages_waiting if p.shard != shard.index]
            self._reconciling.pop(shard.index, None)
            old = shard.sub_id
            if self.firehose:
                requests.append(self._firehose_request(shard, since_full, since_caught_up))
                continue
            if not shard.keys:
                shard.sub_id = None
                if old:
                    requests.append(Request(old, None, [], False))
                continue
            if old:
                # a replaced REQ that never reached EOSE (refused, or cut short) must not keep
                # the relay from counting as live; its late frames fall back to `baselined`
                self._pending.pop(old, None)
            self._generation += 1
            sub_id = f"sp{shard.index}.{self._generation}"
            fresh = frozenset(shard.keys - self.baselined)
            shard.sub_id = sub_id
            since = since_full if fresh else since_caught_up
            keys = sorted(shard.keys)
            cursors = self._cursors(shard, since)
            self._pending[sub_id] = SentReq(sub_id, shard.index, fresh, keys, since, cursors,
                                            lists_new=self._lists_asked(keys))
            reconcile = self._reconcile(shard.index, sub_id, since, fresh)
            requests.append(Request(old, sub_id, self._filters(keys, since, cursors, reconcile),
                                    bool(fresh), reconcile=reconcile))
        # retired REQs of the previous mode close only after their successors are sent
        requests.extend(Request(sub_id, None, [], False) for sub_id in self._retired)
        self._retired = []
        return requests

    def _firehose_request(self, shard: Shard, since_full: int, since_caught_up: int) -> Request:
        """The one REQ of a firehose relay; its `fresh` keys are those not yet baselined."""
        old = shard.sub_id
        if old:
            self._pending.pop(old, None)
        self._generation += 1
        sub_id = f"sp{shard.index}.{self._generation}"
        fresh = frozenset(key for key in self.shard_of if key not in self.baselined)
        since = since_full if fresh else since_caught_up
        shard.sub_id = sub_id
        cursors = self._cursors(shard, since)
        self._pending[sub_id] = SentReq(sub_id, shard.index, fresh, [], since, cursors)
        reconcile = self._reconcile(shard.index, sub_id, since, fresh)
        return Request(old, sub_id, self._filters([], since, cursors, reconcile), bool(fresh),
                       reconcile=reconcile)

    def _reconcile(self, shard: int, sub_id: str, since: int, fresh: frozenset[str]) -> bool:
        """Whether this REQ's window is left to negentropy: only for keys all baselined (a
        fresh key's first answer is its baseline, which only a REQ's EOSE marks)."""
        if fresh or not self.negentropy:
            return False
        self._reconciling[shard] = (sub_id, since)
        return True

    def reconciling(self) -> list[tuple[int, str]]:
        """(shard, live sub id) of every shard waiting for its negentropy catch-up."""
        return [(shard, sub_id) for shard, (sub_id, _) in self._reconciling.items()]

    def reconcile_target(
        self, shard: int, sub_id: str
    ) -> tuple[list[str] | None, list[tuple[tuple[int, ...], int]]] | None:
        """The keys (None: a firehose, every key) of a shard's reconciliation and its parts,
        (kinds, since) each: the DMs from the REQ's `since`, the public kinds the shard asks
        for from `stale_after` back; None when it is moot (the shard was re-requested or the
        connection lost meanwhile)."""
        wanted = self._reconciling.get(shard)
        if wanted is None or wanted[0] != sub_id:
            return None
        keys = None if self.firehose else sorted(self.shards[shard].keys)
        parts: list[tuple[tuple[int, ...], int]] = [(DM_KINDS, wanted[1])]
        public = self._asked.get(shard)
        if public:
            parts.append((tuple(sorted(public)), self._public_since(wanted[1])))
        return keys, parts

    def reconciled(self, shard: int, sub_id: str, missing: list[str]) -> list[Request]:
        """Negentropy found `missing`: fetch them by id, FETCH_BATCH per REQ, as pages (bounded
        in flight like any page). Nothing missing finishes the catch-up at once."""
        wanted = self._reconciling.get(shard)
        if wanted is None or wanted[0] != sub_id:
            return []
        del self._reconciling[shard]
        if not missing:
            return self._pages_ready()
        for start in range(0, len(missing), FETCH_BATCH):
            self._generation += 1
            fetch_id = f"sp{shard}.{self._generation}n"
            self._pages_waiting.append(SentReq(
                fetch_id, shard, frozenset(), [], wanted[1], [], 1, "negentropy",
                missing[start : start + FETCH_BATCH],
            ))
        return self._pages_ready()

    def fell_back(self, shard: int, sub_id: str) -> list[Request]:
        """Negentropy failed: the shard's window is caught up by paged REQ after all."""
        wanted = self._reconciling.get(shard)
        if wanted is None or wanted[0] != sub_id:
            return []
        del self._reconciling[shard]
        since = wanted[1]
        keys = [] if self.firehose else sorted(self.shards[shard].keys)
        self._generation += 1
        page_id = f"sp{shard}.{self._generation}p"
        self._pages_waiting.append(
            SentReq(page_id, shard, frozenset(), keys, since,
                    self._cursors(self.shards[shard], since), 1)
        )
        return self._pages_ready()

    def _dm_kinds(self, extra: int) -> list[tuple[int, ...]]:
        """The kinds of each DM filter a REQ carries: one per kind, or both in one filter on a
        firehose or where the relay's `max_filters` has no room for two (with the list filter
        of a configured relay and `extra` filters counted)."""
        if self.firehose:
            return [DM_KINDS]
        lists = 1 if self.with_lists else 0
        if self._max_filters is not None and len(DM_KINDS) + lists + extra > self._max_filters:
            return [DM_KINDS]
        return [(kind,) for kind in DM_KINDS]

    def _public_since(self, since: int) -> int:
        return max(since, int(time.time()) - self._stale_after)

    def _cursors(self, shard: Shard, since: int) -> list[PageCursor]:
        """One cursor per filter of the shard's REQ: the DM ones, then its public kinds' (when
        any key wants some and the relay's `max_filters` has room), from `stale_after` back.
        The public kinds asked are remembered (`touch`)."""
        public = self._public_kinds(shard)
        groups = self._dm_kinds(1 if public else 0)
        if public and self._max_filters is not None and len(groups) + 1 > self._max_filters:
            public = ()
        self._asked[shard.index] = frozenset(public)
        cursors = [PageCursor(kinds) for kinds in groups]
        if public:
            cursors.append(PageCursor(public, since=self._public_since(since)))
        return cursors

    def _lists_asked(self, keys: list[str]) -> frozenset[str]:
        if not self.with_lists or not (self.lists_new or self.contacts_new):
            return frozenset()
        return frozenset(k for k in keys if k in self.lists_new or k in self.contacts_new)

    def _list_filters(self, keys: list[str], room: int | None) -> list[dict[str, Any]]:
        """Kinds 10050, 10002 and 10000 of every key, kind 3 of the follows-only ones: from
        `lists_since` for keys whose lists came before, whole for the new ones. In one filter
        (kind 3 of all, no `since` if a key is new) where `room` allows no more."""
        since = self._lists_since
        following = [k for k in keys if k in self.follows]
        if since is None:  # every list whole, as before there was a cursor
            new, known, contacts_new, contacts_known = keys, [], following, []
        else:
            new = [k for k in keys if k in self.lists_new]
            known = [k for k in keys if k not in self.lists_new]
            contacts_new = [k for k in following if k in self.lists_new or k in self.contacts_new]
            contacts_known = [k for k in following
                              if k not in self.lists_new and k not in self.contacts_new]
        filters: list[dict[str, Any]] = []
        window = {} if since is None else {"since": since}
        if known:
            filters.append({"kinds": list(UNFILTERED_LIST_KINDS), "authors": known, **window})
        if new:
            filters.append({"kinds": list(UNFILTERED_LIST_KINDS), "authors": new})
        if contacts_known:
            filters.append({"kinds": [CONTACTS], "authors": contacts_known, **window})
        if contacts_new:
            filters.append({"kinds": [CONTACTS], "authors": contacts_new})
        if room is not None and len(filters) > room:
            whole = {} if (new or contacts_new or since is None) else window
            kinds = SUBSCRIBED_LIST_KINDS if following else UNFILTERED_LIST_KINDS
            return [{"kinds": list(kinds), "authors": keys, **whole}]
        return filters

    def _filters(
        self, keys: list[str], since: int, cursors: list[PageCursor], live_only: bool = False
    ) -> list[dict[str, Any]]:
        wanted: list[dict[str, Any]] = []
        for cursor in cursors:
            query: dict[str, Any] = {"kinds": list(cursor.kinds)}
            if not self.firehose:
                query["#p"] = keys
            query["since"] = since if cursor.since is None else cursor.since
            if live_only:
                query["limit"] = 0
            wanted.append(query)
        room = None if self._max_filters is None else self._max_filters - len(wanted)
        if not self.with_lists or (room is not None and room < 1):
            return wanted
        if self.firehose:
            # no key in any filter; relay lists only from the window (they are matched by
            # author locally, like the DMs by recipient)
            return [*wanted, {"kinds": list(SUBSCRIBED_LIST_KINDS), "since": since}]
        return [*wanted, *self._list_filters(keys, room)]

    def _page_filters(self, sent: SentReq) -> list[dict[str, Any]]:
        """One filter per DM filter still paging, each from its own `until`: a relay caps
        each filter on its own, so the kind 4 answer may reach far back while the gift wraps'
        stopped at the cap (or the reverse). A published `max_limit` sizes the pages."""
        if sent.ids is not None:
            return [{"ids": sent.ids}]
        filters = []
        for cursor in sent.cursors:
            query: dict[str, Any] = {"kinds": list(cursor.kinds)}
            if not self.firehose:
                query["#p"] = sent.keys
            query["since"] = sent.since if cursor.since is None else max(sent.since, cursor.since)
            if cursor.until is not None:
                query["until"] = cursor.until
            if self._max_limit:
                query["limit"] = self._max_limit
            filters.append(query)
        return filters

    def stored(self, sub_id: str, event_id: str, kind: int, created_at: int) -> None:
        """Count a DM a REQ returned before its EOSE, towards the page of its filter."""
        sent = self._pending.get(sub_id)
        if sent is not None and (sent.count(event_id, kind, created_at) or sent.ids is not None):
            self.fetched[sent.method] += 1

    def answering(self, sub_id: str) -> bool:
        """Whether `sub_id` is still returning stored events (before its EOSE): a catch-up
        (a shard's, or a watch filter's page)."""
        return sub_id in self._pending or sub_id in self.watch_pages

    def answering_method(self, sub_id: str) -> str | None:
        """The catch-up method of a REQ still returning stored events (`req`, `negentropy`)."""
        sent = self._pending.get(sub_id)
        return None if sent is None else sent.method

    def eose(self, sub_id: str) -> tuple[frozenset[str], list[Request]]:
        """The relay finished a REQ's stored events.

        Returns the keys now baselined and what to send next. Every DM filter whose answer
        added something new and has not reached `since` is asked for its next page (`until` =
        its oldest `created_at` so far), whatever the relay's NIP-11 says: relays cap answers
        silently. The fresh keys are baselined only after the last page, so a crash can never
        leave a baseline whose older events were not seen. A finished page is closed, and the
        page of another shard waiting for room is sent.
        """
        sent = self._pending.pop(sub_id, None)
        if sent is None:
            return frozenset(), []
        if sent.lists_new:
            self.lists_new -= sent.lists_new
            self.contacts_new -= sent.lists_new
        requests: list[Request] = []
        if sent.page:
            self._pages_in_flight.discard(sub_id)
            requests.append(Request(sub_id, None, [], False))
        elif (
            self._reconciling.get(sent.shard, ("",))[0] == sub_id
            and any(cursor.added for cursor in sent.cursors)
        ):
            # the relay ignored `limit` 0 and answered the window itself (nostr-relay does):
            # page on from there; a reconciliation still running for it is moot
            del self._reconciling[sent.shard]
        paging = [cursor for cursor in sent.cursors if cursor.wants_more(sent.since)]
        if paging and sent.page >= MAX_PAGES_PER_CATCHUP:
            self._capped += 1
            paging = []
        if paging:
            for cursor in paging:
                cursor.next_page()
            self._generation += 1
            page_id = f"sp{sent.shard}.{self._generation}p"
            self._pages_waiting.append(SentReq(
                page_id, sent.shard, sent.fresh, sent.keys, sent.since, paging, sent.page + 1
            ))
            return frozenset(), requests + self._pages_ready()
        requests.extend(self._pages_ready())
        if sent.method == "req" and (
            sent.page or self._reconciling.get(sent.shard, ("",))[0] != sub_id
        ):
            # a live REQ whose window negentropy catches up is not a finished catch-up, nor
            # is one fetch of many (the pool counts each reconciliation once)
            self.finished["req"] += 1
        # on a firehose every key on the relay was covered by this REQ, even one added meanwhile
        # (a set difference in C: a Python loop over a million keys stalled the event loop)
        if self.firehose:
            newly = frozenset(self.shard_of.keys() - self.baselined)
        else:
            newly = frozenset(key for key in sent.fresh if key in self.shard_of) - self.baselined
        self.baselined |= newly
        return newly, requests

    def _pages_ready(self) -> list[Request]:
        """Waiting pages that fit in the relay's room for pages in flight, oldest first."""
        room = (1 if self._max_shards is not None else PAGES_IN_FLIGHT) - len(
            self._pages_in_flight
        )
        ready, self._pages_waiting = self._pages_waiting[:max(0, room)], self._pages_waiting[
            max(0, room):
        ]
        requests = []
        for page in ready:
            self._pending[page.sub_id] = page
            self._pages_in_flight.add(page.sub_id)
            requests.append(Request(None, page.sub_id, self._page_filters(page),
                                    bool(page.fresh), page=True))
        return requests

    def take_capped(self) -> int:
        """Catch-ups that stopped at MAX_PAGES_PER_CATCHUP since the last call."""
        capped, self._capped = self._capped, 0
        return capped

    @property
    def pages_waiting(self) -> int:
        return len(self._pages_waiting)

    @property
    def answering_any(self) -> bool:
        """Some REQ is still returning stored events (cheap: checked for every frame)."""
        return bool(self._pending) or bool(self.watch_pages)

    def closed(self, sub_id: str) -> list[Request]:
        """The relay ended a REQ without EOSE; its fresh keys stay fresh. A refused page frees
        its room for a waiting one (returned, to be sent)."""
        sent = self._pending.pop(sub_id, None)
        if sent is None:
            return []
        self._refused.add(sent.shard)
        if sent.page:
            self._pages_in_flight.discard(sub_id)
            return self._pages_ready()
        return []

    def is_baseline(self, sub_id: str, recipient: str) -> bool:
        """Whether an event for `recipient` on `sub_id` predates the key's first subscription here."""
        sent = self._pending.get(sub_id)
        if sent is not None:
            return recipient in sent.fresh
        return recipient in self.shard_of and recipient not in self.baselined

    @property
    def streaming(self) -> bool:
        """A firehose with no REQ awaiting EOSE: every event is live, none needs counting
        towards a page of stored events."""
        return (self.firehose and not self._pending and not self._pages_waiting
                and not self.watch_pages)

    def catching_up(self, sub_id: str, recipient: str) -> bool:
        """Firehose: whether an event for `recipient` may predate its registration (it came
        before the REQ's EOSE, or the key is not baselined here yet)."""
        return sub_id in self._pending or recipient not in self.baselined

    @property
    def live(self) -> bool:
        return (
            not self._pending
            and not self._pages_waiting
            and not self._reconciling
            and not self._refused
            and not any(shard.dirty for shard in self.shards)
        )

    @property
    def subscription_count(self) -> int:
        return sum(1 for shard in self.shards if shard.sub_id)
