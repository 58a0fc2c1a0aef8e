"""Key sharding and the first-subscription baseline for one relay.

Keys are packed into shards (one REQ each) that stay stable: adding or removing a key changes
exactly one shard, so only that shard is re-requested and the others keep streaming.

Every REQ gets a fresh subscription id (`<shard>.<generation>`), so frames of a replaced REQ
can be told apart from frames of its successor. A key is "fresh" on a relay until the relay
has sent EOSE for a REQ that included it: what the relay returns before that EOSE predates the
registration and is remembered as seen, not pushed (CONTRACT section 5).

A relay in firehose mode has one REQ for every DM (`{"kinds": [4, 1059]}`, no `#p`) whatever
the number of keys: adding or removing a key sends nothing, and the relay learns nothing about
who is registered. Keys join the baseline as soon as that REQ is past EOSE (events stored
before its EOSE are checked against the recipient's registration time instead, by the bridge).
Switching mode sends the new REQs before closing the old ones, from the relay's cursor, so the
switch loses nothing and de-duplication absorbs the overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sigil_push.relays.discovery import SUBSCRIBED_LIST_KINDS
from sigil_push.relays.nip11 import RelayLimits

DM_KINDS = (4, 1059)
KEY_BYTES_IN_FILTER = 67  # 64 hex digits, two quotes, one comma
REQ_OVERHEAD_BYTES = 512


@dataclass(slots=True)
class Shard:
    index: int
    keys: set[str] = field(default_factory=set)
    dirty: bool = True
    sub_id: str | None = None


@dataclass(slots=True)
class SentReq:
    """A REQ as it was sent (which shard, which of its keys were fresh then) and, until its
    EOSE, how many stored events it returned and the oldest `created_at` among them."""

    sub_id: str
    shard: int
    fresh: frozenset[str]
    keys: list[str]
    since: int
    until: int | None = None
    stored: int = 0
    oldest: int | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """What the caller must send to bring one shard up to date."""

    close: str | None
    sub_id: str | None
    filters: list[dict[str, Any]]
    fresh: bool


class RelaySubscriptions:
    def __init__(
        self, keys_per_filter: int, with_lists: bool, baselined: set[str] | None = None
    ) -> None:
        self._keys_per_filter = max(1, keys_per_filter)
        self._capacity = self._keys_per_filter
        self.with_lists = with_lists
        self.baselined: set[str] = baselined if baselined is not None else set()
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

    @property
    def keys(self) -> dict[str, int]:
        return self.shard_of

    def add(self, key: str) -> None:
        """Put a key into the first shard with room; past the relay's subscription limit, a
        shard grows up to the message size limit, and beyond that the key waits unsubscribed."""
        if key in self.shard_of or key in self.overflow:
            return
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

    def remove(self, key: str) -> None:
        self.overflow.discard(key)
        index = self.shard_of.pop(key, None)
        self.baselined.discard(key)
        self._newly_baselined.discard(key)
        if index is not None and not self.firehose:
            shard = self.shards[index]
            shard.keys.discard(key)
            shard.dirty = True
            self._first_with_room = min(self._first_with_room, index)
            if self.overflow:
                self.add(self.overflow.pop())

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
            self.add(key)
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
        for key in keys:
            self.add(key)
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
        for shard in self.shards:
            shard.dirty = True
            shard.sub_id = None

    def refresh(self) -> None:
        """Re-request every shard (after AUTH), closing the previous REQs."""
        for shard in self.shards:
            shard.dirty = True

    def due(self, since_full: int, since_caught_up: int) -> list[Request]:
        """Requests for every changed shard; marks them clean.

        A shard with fresh keys asks for the whole catch-up window (its pre-EOSE answer is the
        baseline); one whose keys are all baselined may ask from the relay's cursor.
        """
        requests = []
        for shard in self.shards:
            if not shard.dirty:
                continue
            shard.dirty = False
            self._refused.discard(shard.index)
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
            self._pending[sub_id] = SentReq(sub_id, shard.index, fresh, keys, since)
            requests.append(Request(old, sub_id, self._filters(keys, since), bool(fresh)))
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
        self._pending[sub_id] = SentReq(sub_id, shard.index, fresh, [], since)
        return Request(old, sub_id, self._filters([], since), bool(fresh))

    def _filters(
        self, keys: list[str], since: int, until: int | None = None
    ) -> list[dict[str, Any]]:
        window: dict[str, Any] = (
            {"since": since} if until is None else {"since": since, "until": until}
        )
        if self.firehose:
            # no key in any filter; relay lists only from the window (they are matched by
            # author locally, like the DMs by recipient)
            fire = [{"kinds": list(DM_KINDS), **window}]
            if self.with_lists and (self._max_filters is None or self._max_filters >= 2):
                fire.append({"kinds": list(SUBSCRIBED_LIST_KINDS), **window})
            return fire
        dm = [{"kinds": [kind], "#p": keys, **window} for kind in DM_KINDS]
        lists = [{"kinds": list(SUBSCRIBED_LIST_KINDS), "authors": keys}] if self.with_lists else []
        if self._max_filters is not None and len(dm) + len(lists) > self._max_filters:
            dm = [{"kinds": list(DM_KINDS), "#p": keys, **window}]
            if len(dm) + len(lists) > self._max_filters:
                lists = []
        return dm + lists

    def stored(self, sub_id: str, created_at: int) -> None:
        """Count a DM returned before EOSE, to tell whether the relay's limit cut the answer."""
        sent = self._pending.get(sub_id)
        if sent is not None:
            sent.stored += 1
            if sent.oldest is None or created_at < sent.oldest:
                sent.oldest = created_at

    def eose(self, sub_id: str) -> tuple[frozenset[str], Request | None]:
        """The relay finished a REQ's stored events.

        Returns the keys now baselined, and what to send next: when the relay publishes a
        `max_limit` and the answer reached it, the older events are asked for page by page
        (`until` = the oldest so far) and the fresh keys are baselined only after the last page,
        so a crash can never leave a baseline whose older events were not seen. A finished page
        is closed.
        """
        sent = self._pending.pop(sub_id, None)
        if sent is None:
            return frozenset(), None
        close = sub_id if sent.until is not None else None
        limit = self._max_limit
        if (
            limit
            and sent.stored >= limit
            and sent.oldest is not None
            and (sent.until is None or sent.oldest < sent.until)
            and sent.oldest > sent.since
        ):
            self._generation += 1
            page_id = f"sp{sent.shard}.{self._generation}p"
            self._pending[page_id] = SentReq(
                page_id, sent.shard, sent.fresh, sent.keys, sent.since, until=sent.oldest
            )
            filters = self._filters(sent.keys, sent.since, sent.oldest)
            return frozenset(), Request(close, page_id, filters, bool(sent.fresh))
        # on a firehose every key on the relay was covered by this REQ, even one added meanwhile
        # (a set difference in C: a Python loop over a million keys stalled the event loop)
        if self.firehose:
            newly = frozenset(self.shard_of.keys() - self.baselined)
        else:
            newly = frozenset(key for key in sent.fresh if key in self.shard_of) - self.baselined
        self.baselined |= newly
        return newly, Request(close, None, [], False) if close else None

    def closed(self, sub_id: str) -> None:
        """The relay ended a REQ without EOSE; its fresh keys stay fresh."""
        sent = self._pending.pop(sub_id, None)
        if sent is not None:
            self._refused.add(sent.shard)

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
        return self.firehose and not self._pending

    def catching_up(self, sub_id: str, recipient: str) -> bool:
        """Firehose: whether an event for `recipient` may predate its registration (it came
        before the REQ's EOSE, or the key is not baselined here yet)."""
        return sub_id in self._pending or recipient not in self.baselined

    @property
    def live(self) -> bool:
        return (
            not self._pending
            and not self._refused
            and not any(shard.dirty for shard in self.shards)
        )

    @property
    def subscription_count(self) -> int:
        return sum(1 for shard in self.shards if shard.sub_id)
