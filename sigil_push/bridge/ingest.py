"""Ingest: a relay frame in, a verified arrival queued for the committer out.

Frames are parsed, checked and verified synchronously as they arrive (no event is remembered or
pushed before its id and BIP-340 signature verify), and whether an event is a pre-registration
baseline is decided right then, from the REQ it answered. Nothing here waits on the database:
the restart-proof dedupe is read from its in-memory cache, everything else is the committer's.
The pool calls these methods through the bridge's port (`relays.port.FrameSink`), once per
frame: each frame carries its subscription context (`RelayFeed`), and each answer is a verdict
(`Stored`, `Verdict`) that the pool applies to its own subscriptions. Ingest never reads or
writes the pool.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Container, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from sigil_push.bridge.catchup_ledger import CatchupLedger
from sigil_push.bridge.iris_watches import IrisWatches
from sigil_push.bridge.metrics import ZAP_REQUESTS_BY, RelayCounters, remove_relay_series
from sigil_push.bridge.pending import Arrival, Pending
from sigil_push.bridge.user_lists import USER_LIST_KINDS_SET, user_list_of
from sigil_push.bridge.verified import RecentlyVerified, Verified
from sigil_push.bridge.watches import DM_KINDS, WATCHABLE_KINDS, ZAP_RECEIPT, Watch
from sigil_push.config import BridgeConfig
from sigil_push.nostr.event import Event, InvalidEvent, compute_id
from sigil_push.nostr.nip57 import zap_request_author
from sigil_push.relays.budget import ConnectionBudget
from sigil_push.relays.discovery import (
    LIST_KINDS_SET,
    SUBSCRIBED_LIST_KINDS,
    SUBSCRIBED_LIST_KINDS_SET,
    RelayLists,
)
from sigil_push.relays.port import Frame, Outcome, RelayFeed, Stored, Verdict
from sigil_push.relays.watch_requests import WatchPlan
from sigil_push.store.interface import SeenStore
from sigil_push.telemetry.memory_gauges import track
from sigil_push.token_bucket import refill

if TYPE_CHECKING:
    from sigil_push.canary import Canary

LookedUp = tuple[str, tuple[str, ...] | None]
"""An id `text` read off a frame and the seen cache's relays for it (see `_admit`)."""
MAX_FUTURE_SECONDS = 15 * 60
GIFT_WRAP_LAG_SECONDS = 2 * 24 * 3600
"""NIP-59 lets a gift wrap's `created_at` lag up to two days behind its real time."""
PAST_SLACK_SECONDS = GIFT_WRAP_LAG_SECONDS + 15 * 60
RECIPIENT_EVENTS_PER_SECOND = 1.0
RECIPIENT_BURST = 60.0
"""Per recipient key, across relays: a DM flood to one key (e.g. to oneself) stays that key's
cost. Twice the default per-device push rate (30 a minute): wakeups past it would only
coalesce into the same "new message" anyway."""
COUNTS_FLUSH_SECONDS = 0.5
RECENTLY_VERIFIED = 10_000
"""Verified events kept by id for the copies other relays deliver (10 to 20 s at 1,000/s)."""


class TokenBucket:
    """`rate` tokens a second up to `burst`; `take()` spends one if there is one."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, rate: float, burst: float) -> None:
        self._rate, self._burst = rate, burst
        self._tokens = burst
        self._stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = refill(self._tokens, self._stamp, now, self._rate, self._burst)
        self._stamp = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def full(self) -> bool:
        """Refilled completely (so forgetting the bucket changes nothing)."""
        now = time.monotonic()
        return refill(self._tokens, self._stamp, now, self._rate, self._burst) >= self._burst


class Ingest:
    """The readers' side of the bridge (the port's `FrameSink`): every frame from the pool's
    shared connections (`text`, `event`) and from users' own connections to gated relays
    (`user_event`), dropped with a counted reason or queued as an `Arrival`.

    `keys` is the key registry's set of watched keys (the same set, kept current there); a
    key's newer relay list goes to `lists` (which tells the registry); a watched key's
    verified mute or contact list goes to the committer through `pending`, which stores it.
    """

    def __init__(
        self,
        settings: BridgeConfig,
        pending: Pending,
        seen: SeenStore,
        lists: RelayLists,
        counters: dict[str, RelayCounters],
        keys: set[str],
        ledger: CatchupLedger,
        wants: Mapping[str, frozenset[int]] | None = None,
        iris: IrisWatches | None = None,
    ) -> None:
        """`seen` and `lists` are the dedupe and the relay lists on the bridge's connection;
        `counters` the per-relay counters, by relay URL (the committer counts its own drops,
        duplicates and no device, in the same dict). `wants`: each watched key's public kinds
        (the key registry's, kept current there; keys that want DMs only are absent); `iris`:
        the Iris subscriptions' watches (asked only while `iris.active`, so without
        subscriptions no event pays for them)."""
        self._wants: Mapping[str, frozenset[int]] = wants if wants is not None else {}
        self._iris = iris if iris is not None else IrisWatches(None, WatchPlan())
        self._bridge = settings
        self._ledger = ledger
        self._enqueue = pending.enqueue
        self._fold = pending.fold
        self._keys = keys
        self._offer_list = pending.offer_list
        self._recent = RecentlyVerified(RECENTLY_VERIFIED)
        self._unaddressed: dict[str, int] = {}
        self._received: dict[str, int] = {}
        self._counts_flush: asyncio.TimerHandle | None = None
        self._recipient_buckets: dict[str, TokenBucket] = {}
        track("recipient_buckets", self, lambda i: len(i._recipient_buckets))
        track("relay_counters", self, lambda i: len(i.counters) + len(i._user_counters))
        self.counters = counters
        self._user_counters: dict[str, RelayCounters] = {}
        self._lists = lists
        self._seen = seen
        self._probe: Canary | None = None

    def add_probe(self, probe: Canary) -> None:
        self._probe = probe

    def stop(self) -> None:
        """Count the frames still held back (the relays are closed by now)."""
        if self._counts_flush is not None:
            self._counts_flush.cancel()
            self._flush_counts()

    def forget_full_buckets(self) -> None:
        """Housekeeping: drop the quota buckets that have refilled (forgetting them is free)."""
        self._recipient_buckets = {
            key: bucket for key, bucket in self._recipient_buckets.items() if not bucket.full()
        }

    # pool callbacks (synchronous, on the readers' tasks) ----------------------------------

    def relay_added(self, url: str, budget: ConnectionBudget | None = None) -> None:
        """A shared connection opened to `url`; `budget` is charged for its invalid events."""
        self.counters[url] = RelayCounters(url, budget)

    def relay_removed(self, url: str) -> None:
        """The pool stopped using `url`: its counters and their series go (URLs churn)."""
        self._received.pop(url, None)
        self._unaddressed.pop(url, None)
        self.counters.pop(url, None)
        self._user_counters.pop(url, None)
        remove_relay_series(url)

    def user_event(
        self, url: str, pubkey: str, raw: Any, received_ms: int, baseline: bool,
        budget: ConnectionBudget | None = None,
    ) -> None:
        """An event from `pubkey`'s own connection to a gated relay: the same checks, dedupe
        and commit path as `event`, pushed to that user only (it answered their REQ) and
        not at all when it predates their first subscription there (`baseline`). `budget`:
        that connection's, charged for this event's invalidity and signature check."""
        # counters of their own: the shared socket does not pay for per-user sockets' events
        counters = self._user_counters.get(url)
        if counters is None:
            counters = self._user_counters[url] = RelayCounters(url)
            self.counters.setdefault(url, counters)  # the committer counts by URL
        # the per-user sockets to one URL share these counters; each call is synchronous, so
        # the budget set here is the delivering socket's for the whole of this event
        counters.budget = budget
        counters.received.inc()
        entry = self._admit(counters, url, "", raw, received_ms, False, (pubkey,))
        if not isinstance(entry, Verified):
            return
        event = entry.event
        if event.kind not in DM_KINDS:
            counters.dropped["wrong_kind"].inc()
            return
        if pubkey not in self._keys or pubkey not in event.tag_values("p"):
            counters.invalid("unknown_recipient")
            return
        arrival = entry.arrival
        if arrival is not None and self._fold(arrival, url, received_ms):
            return
        self._hand_over(counters, entry, url, received_ms, () if baseline else (pubkey,))

    def event(self, frame: Frame, raw: Any) -> Outcome:
        """An event from the pool's connection to `frame.feed.url`. It may wake only keys
        subscribed on that relay (a relay cannot push keys it was never asked about; on a
        firehose relay every key there counts as subscribed). The signature is checked before
        any recipient lookup, so a forged event counts as `forged` whether or not its recipient
        is registered: public counters do not tell who is. The one lookup that comes first is
        the firehose's: an event naming no key on the relay is dropped as `unaddressed` before
        any parse or signature check, which is what makes reading every DM affordable."""
        return self._event(frame, raw, None)

    def _event(self, frame: Frame, raw: Any, looked_up: LookedUp | None) -> Outcome:
        """`event`, with what `text` already looked up of the frame's id (see `_admit`)."""
        feed = frame.feed
        url = feed.url
        counters = self.counters[url]
        self._count_received(url)
        subs = feed.subs
        if subs.firehose and not _addressed(raw, subs.keys) and not (
            self._iris.active and self._iris.maybe_raw(raw)
        ):
            counters.dropped["unaddressed"].inc()
            self._ledger.note_unaddressed_event(url, raw)
            return _stored_anyway(frame.sub_id, raw)
        entry = self._admit(
            counters, url, frame.sub_id, raw, frame.received_ms, feed.configured, subs.keys,
            looked_up,
        )
        if not isinstance(entry, Verified):
            return entry
        return self._route(counters, feed, frame.sub_id, entry, frame.received_ms)

    def _route(
        self,
        counters: RelayCounters,
        feed: RelayFeed,
        sub_id: str,
        entry: Verified,
        received_ms: int,
    ) -> Outcome:
        """A verified event from the shared connection to `feed.url`: to the recipients
        subscribed there, the relay lists, or the canary."""
        url, subs = feed.url, feed.subs
        subscribed = subs.keys
        event = entry.event
        zap_author: str | None = None
        # Iris subscriptions' watches, whole filters on the verified event (none: one check)
        iris = self._iris.matching(event, entry.tagged) if self._iris.active else ()
        if event.kind in DM_KINDS:
            tagged = entry.tagged
            recipients: tuple[str, ...]
            if len(tagged) == 1:  # nearly every DM: no generator
                recipients = tagged if tagged[0] in subscribed else ()
            else:
                recipients = tuple(p for p in tagged if p in subscribed)
            if not recipients and not iris:
                counters.invalid("unknown_recipient")
                return Verdict.TAKEN
        elif event.kind in WATCHABLE_KINDS:
            recipients = self._wanting(event.kind, entry.tagged, subscribed)
            if not recipients and not iris:
                counters.dropped["unaddressed"].inc()
                if subs.answering(sub_id):
                    return Stored(sub_id, event.id, event.kind, event.created_at)
                return Verdict.TAKEN
            if event.kind == ZAP_RECEIPT:
                zap_author, outcome = zap_request_author(event)
                ZAP_REQUESTS_BY[outcome].inc()
        elif event.kind in LIST_KINDS_SET and feed.configured:
            if event.pubkey not in subscribed:
                counters.invalid("unknown_recipient")
                return Verdict.TAKEN
            self._lists.offer(event)  # the key registry is told when its DM relays changed
            return Verdict.TAKEN
        elif event.kind in USER_LIST_KINDS_SET and feed.configured:
            if event.pubkey not in subscribed and not self._iris.owns(event.pubkey):
                counters.dropped["unknown_recipient"].inc()
                return Verdict.TAKEN
            self._offer_list(user_list_of(event))
            return Verdict.TAKEN
        elif iris:
            recipients = ()
        else:
            counters.dropped["wrong_kind"].inc()
            if subs.answering(sub_id):  # an Iris watch's page: a place in its answer
                return Stored(sub_id, event.id, event.kind, event.created_at)
            return Verdict.TAKEN
        # a place in a REQ's answer only counts while that REQ is answering (a catch-up's
        # page): a live DM, nearly every frame, is no page's, and the pool has nothing to count
        answering = subs.answering(sub_id)
        stored: Outcome = (
            Stored(sub_id, event.id, event.kind, event.created_at) if answering
            else Verdict.TAKEN
        )
        self._ledger.note(url, event.id, event.created_at, recipients)
        if self._probe is not None and self._probe.take(url, event):
            return stored
        arrival = entry.arrival
        if arrival is not None and self._fold(arrival, url, received_ms):
            # a further relay's copy while the event still waits for the committer
            return stored
        # a stored answer (catch-up) is bounded by its pages, not by the recipients' live rate:
        # most of it is history the committer will find handled, and charging it would drop
        # the outage's new DMs as `recipient_quota` (to come back only at the next catch-up)
        charge = not answering
        if subs.firehose:
            since_registration = tuple(r for r in recipients if subs.catching_up(sub_id, r))
            self._hand_over(
                counters, entry, url, received_ms, recipients, since_registration, charge,
                zap_author, iris,
            )
            return stored
        # a key still fresh here is woken only for what was made after its registration (the
        # committer's `since_registration` rule): its baseline row can be missing for a key
        # registered long ago, when the worker that stored it was killed before the commit
        # and another worker took the shard over; every DM sent since would be swallowed
        fresh: tuple[str, ...]
        if len(recipients) == 1:
            fresh = recipients if subs.is_baseline(sub_id, recipients[0]) else ()
        else:
            fresh = tuple(r for r in recipients if subs.is_baseline(sub_id, r))
        self._hand_over(
            counters, entry, url, received_ms, recipients, fresh, charge, zap_author, iris
        )
        return stored

    def _wanting(
        self, kind: int, tagged: Sequence[str], subscribed: Container[str]
    ) -> tuple[str, ...]:
        """The keys among `tagged` subscribed here whose pairs want `kind` (a public kind)."""
        wants = self._wants
        found: list[str] = []
        for key in tagged:
            kinds = wants.get(key)
            if kinds is not None and kind in kinds and key in subscribed:
                found.append(key)
        return tuple(found)

    def text(self, feed: RelayFeed, frame: str, received_ms: int) -> Outcome:
        """A frame from the shared connection to `feed.url`, before it is parsed; anything but
        `Verdict.UNPARSED` when it was handled here, so it is never parsed at all:

        - on a live firehose, a frame naming no key on the relay is dropped and counted as
          `unaddressed`. The scan finds every `"p","<hex>"` pair in the raw text; in JSON
          such a pair can only be structure (quotes inside strings are escaped), so a pair
          found in the wrong place only sends the frame on to the full checks, never drops
          it. Relay lists and frames before a REQ's EOSE always take the full path;
        - a copy of an event verified moments ago (its id found in the text) is that relay's
          delivery of the verified original, exactly as in `_admit`: nothing else of the
          frame is used, so a relay that wraps a known id in another body gains only the
          record that it delivered that id;
        - a repeat of an id this relay delivered before (a reconnect's catch-up replays what
          it stored) is a duplicate before any parse (`_repeat`), as `_admit` would count it;
        - any other EVENT frame is parsed here (`_parsed_event`), the connection's own parse
          skipped.
        """
        if not frame.startswith('["EVENT"'):
            return Verdict.UNPARSED
        url, subs = feed.url, feed.subs
        if subs.streaming and self._unaddressed_frame(url, frame, subs.keys):
            return Verdict.TAKEN
        # the usual layout, the id first in the event: one match finds the sub id and the id
        # (the same id the search below finds: a sub id holds no quote)
        head = _COPY_HEAD.match(frame)
        if head is not None:
            sub_id, event_id = head.groups()
        else:
            found = _EVENT_ID.search(frame)
            head = _FRAME_HEAD.match(frame)
            if found is None or head is None:
                return self._parsed_event(feed, frame, received_ms, None)
            sub_id, event_id = head.group(1), found.group(1)
        entry = self._recent.get(event_id)
        if entry is None:
            if subs.firehose and not subs.streaming:
                return self._parsed_event(feed, frame, received_ms, None)
            # one lookup of the id for both questions: this relay's repeat here, a handled
            # event's copy in `_admit`
            relays = self._seen.relays(event_id)
            if relays is not None and url in relays:
                repeat = self._repeat(url, sub_id, event_id, frame)
                if repeat is not None:
                    return repeat
            return self._parsed_event(feed, frame, received_ms, (event_id, relays))
        counters = self.counters[url]
        self._count_received(url)
        event = entry.event
        if self._seen.delivered_by(event.id, url):
            counters.duplicates.inc()
            if subs.answering(sub_id):
                return Stored(sub_id, event.id, event.kind, event.created_at)
            return Verdict.TAKEN
        return self._route(counters, feed, sub_id, entry, received_ms)

    def _repeat(self, url: str, sub_id: str, event_id: str, frame: str) -> Outcome | None:
        """A frame whose id this relay already delivered: a duplicate, whatever its body, and
        still a place in its REQ's answer (`_stored_anyway`, from the kind and time read off
        the text: as there, the relay's own word, only used to page that relay). None when
        the text does not show them plainly: the frame then takes the parse."""
        kind, created_at = _KIND.search(frame), _CREATED_AT.search(frame)
        if kind is None or created_at is None:
            return None
        self._count_received(url)
        self.counters[url].duplicates.inc()
        # any kind: an Iris watch's catch-up page asks for kinds no shard does (the pool
        # counts a place only for a REQ still answering)
        return Stored(sub_id, event_id, int(kind.group(1)), int(created_at.group(1)))

    def _parsed_event(
        self, feed: RelayFeed, frame: str, received_ms: int, looked_up: LookedUp | None
    ) -> Outcome:
        """An EVENT frame parsed with orjson (a third of `json.loads`' instructions on a DM
        frame) and handed to `event`, as the connection would have. A frame orjson refuses,
        or whose shape is not `["EVENT", <string>, <anything>]`, goes back to the connection
        (`Verdict.UNPARSED`), whose own
        parser decides as it always has: `json.loads` accepts a little more (NaN, a lone
        surrogate, integers past 64 bits), all of it refused later as malformed anyway."""
        try:
            message = orjson.loads(frame)
        except orjson.JSONDecodeError:
            return Verdict.UNPARSED
        # the '["EVENT"' prefix makes the first element exactly "EVENT"
        if type(message) is not list or len(message) < 3 or type(message[1]) is not str:
            return Verdict.UNPARSED
        return self._event(Frame(feed, message[1], received_ms), message[2], looked_up)

    def _unaddressed_frame(self, url: str, frame: str, keys: Mapping[str, int]) -> bool:
        found = _ADDRESSING.findall(frame)
        for key, list_kind in found:
            if list_kind or key in keys:
                return False
        if self._iris.active and self._iris.maybe_text(frame, [key for key, _ in found]):
            return False
        self._ledger.note_unaddressed(url, frame)
        self._unaddressed[url] = self._unaddressed.get(url, 0) + 1
        self._count_received(url)
        return True

    def _count_received(self, url: str) -> None:
        """Frames are counted in bulk (a lock-free int now, the Prometheus counters within a
        second): a locked increment per frame costs as much as a firehose scan."""
        self._received[url] = self._received.get(url, 0) + 1
        if self._counts_flush is None:
            self._counts_flush = asyncio.get_running_loop().call_later(
                COUNTS_FLUSH_SECONDS, self._flush_counts
            )

    def _flush_counts(self) -> None:
        """Hand the bulk counts (frames received, unaddressed drops) to Prometheus."""
        received, self._received = self._received, {}
        unaddressed, self._unaddressed = self._unaddressed, {}
        self._counts_flush = None
        for url, count in received.items():
            counters = self.counters.get(url)
            if counters is not None:
                counters.received.inc(count)
        for url, count in unaddressed.items():
            counters = self.counters.get(url)
            if counters is not None:
                counters.dropped["unaddressed"].inc(count)

    def _admit(
        self, counters: RelayCounters, url: str, sub_id: str, raw: Any, received_ms: int,
        lists: bool, keys: Container[str], looked_up: LookedUp | None = None,
    ) -> Verified | Outcome:
        """The verified event behind a frame, or the verdict on a frame dropped (counted), a
        repeat from this relay, or a further relay's copy of a handled event (its delivery is
        queued here, and noted for the catch-up ledger under the `keys` the frame's
        subscription carries). A copy of an event verified moments ago reuses that verified original:
        no parse, no signature check, and nothing of the copy's own body is used.

        `looked_up` is what `text` found for the id it read off the frame (not recently
        verified, and the relays the seen cache knows for it): used only when the parsed
        event carries that same id; otherwise (`unchecked`) the id is looked up here."""
        event_id = raw.get("id") if isinstance(raw, dict) else None
        if type(event_id) is str:
            if looked_up is not None and looked_up[0] == event_id:
                unchecked, relays = False, looked_up[1]
            else:
                unchecked, relays = True, self._seen.relays(event_id)
            if relays is not None and url in relays:
                counters.duplicates.inc()
                return _stored_anyway(sub_id, raw)
            if unchecked:
                entry = self._recent.get(event_id)
                if entry is not None:
                    return entry
            if relays is not None:
                return self._handled_copy(counters, url, sub_id, raw, received_ms, keys)
        try:
            event = Event.from_json(raw)
        except InvalidEvent:
            counters.invalid("malformed")
            return Verdict.TAKEN
        kind = event.kind
        is_list = kind in SUBSCRIBED_LIST_KINDS_SET
        if kind not in DM_KINDS and not (is_list and lists):
            # a public kind (or a kind only an Iris watch takes): its recipients before its
            # signature (most of a firehose's notes, reactions and zaps name nobody here who
            # wants them)
            iris = self._iris
            watched = iris.active and iris.maybe(kind, event.tags, event.pubkey)
            if kind not in WATCHABLE_KINDS:
                if not watched:
                    counters.dropped["wrong_kind"].inc()
                    return _stored_anyway(sub_id, raw)
            elif not watched and not self._addressed_public(event, keys):
                counters.dropped["unaddressed"].inc()
                return _stored_anyway(sub_id, raw)
        if not (self._in_window(counters, event, is_list) and self._verified(counters, event)):
            return Verdict.TAKEN
        return self._recent.add(event)

    def _addressed_public(self, event: Event, keys: Container[str]) -> bool:
        """Whether a `p` tag of a public-kind event names a key subscribed here that wants its
        kind (a hash lookup per tag; no signature checked yet)."""
        wants = self._wants
        if not wants:
            return False
        kind = event.kind
        for tag in event.tags:
            if len(tag) >= 2 and tag[0] == "p":
                kinds = wants.get(tag[1])
                if kinds is not None and kind in kinds and tag[1] in keys:
                    return True
        return False

    def _handled_copy(
        self, counters: RelayCounters, url: str, sub_id: str, raw: Any, received_ms: int,
        keys: Container[str],
    ) -> Outcome:
        """A further relay's copy of an event already handled (pushed or baselined) that is no
        longer among the recently verified. It can push nothing, so only its delivery is
        recorded; its id is recomputed from its body (a hash, not a signature check: that id
        was verified when first handled), so the record carries the true kind and time."""
        try:
            event = Event.from_json(raw)
        except InvalidEvent:
            counters.invalid("malformed")
            return Verdict.TAKEN
        if compute_id(event.pubkey, event.created_at, event.kind, event.tags, event.content) != (
            event.id
        ):
            counters.invalid("wrong_id")
            return Verdict.TAKEN
        self._ledger.note(
            url, event.id, event.created_at, tuple(p for p in event.tag_values("p") if p in keys)
        )
        self._enqueue(Arrival(event, url, received_ms, ()))
        return Stored(sub_id, event.id, event.kind, event.created_at)

    def _hand_over(
        self,
        counters: RelayCounters,
        entry: Verified,
        url: str,
        received_ms: int,
        push_to: tuple[str, ...],
        since_registration: tuple[str, ...] = (),
        charge: bool = True,
        zap_author: str | None = None,
        iris: tuple[Watch, ...] = (),
    ) -> None:
        """Queue for the committer. Recipients' quotas are spent once per event, not once per
        relay that delivers a copy (the committer pushes an event at most once anyway), and
        not for `since_registration` recipients nor for a catch-up's stored answer (`charge`
        False): history must not use up a quota (an event dropped for quota is not marked
        seen, and would be pushed as new only by the next catch-up). Iris subscribers whose
        watches it matches (`iris`) are charged like recipients."""
        charged: tuple[str, ...] = ()
        if charge:
            charged = (
                push_to if not since_registration
                else tuple(r for r in push_to if r not in since_registration)
            )
            if iris:
                charged += tuple(dict.fromkeys(watch.owner for watch in iris))
        if charged and not entry.enqueued and not self._within_quota(counters, charged):
            return
        entry.enqueued = True
        arrival = entry.arrival = Arrival(
            entry.event, url, received_ms, push_to, since_registration, zap_author=zap_author,
            iris=iris,
        )
        self._enqueue(arrival)

    def _in_window(self, counters: RelayCounters, event: Event, is_list: bool) -> bool:
        """`created_at` within [now - catch-up - slack, now + 15 min], checked before anything
        is stored: a far-future time would overflow the database's integers or pin a relay
        list forever, an old one is a replay from past the dedupe window. Relay lists are
        long-lived replaceable events, so only their upper bound applies."""
        now = int(time.time())
        if event.created_at > now + MAX_FUTURE_SECONDS:
            counters.invalid("too_new")
            return False
        if not is_list and event.created_at < now - self._bridge.catchup_seconds - PAST_SLACK_SECONDS:
            counters.invalid("too_old")
            return False
        return True

    def _within_quota(self, counters: RelayCounters, push_to: tuple[str, ...]) -> bool:
        """Spend one token of each recipient's bucket; False (counted) when none had one."""
        allowed = False
        for recipient in push_to:
            bucket = self._recipient_buckets.get(recipient)
            if bucket is None:
                bucket = self._recipient_buckets[recipient] = TokenBucket(
                    RECIPIENT_EVENTS_PER_SECOND, RECIPIENT_BURST
                )
            allowed = bucket.take() or allowed
        if not allowed:
            counters.dropped["recipient_quota"].inc()
        return allowed

    @staticmethod
    def _verified(counters: RelayCounters, event: Event) -> bool:
        """Id and signature check, last because it is the costliest; failures counted by kind,
        and each check charged to the delivering socket's verification budget."""
        if counters.budget is not None:
            counters.budget.verified()
        try:
            event.verify()
        except InvalidEvent as exc:
            counters.invalid("wrong_id" if exc.reason == "id_mismatch" else "forged")
            return False
        return True


_ADDRESSING = re.compile(
    r'"p"\s*,\s*"([0-9a-f]{64})"|"kind"\s*:\s*('
    + "|".join(str(kind) for kind in SUBSCRIBED_LIST_KINDS)
    + r')\b'
)
"""A `p` tag's key, or a list kind (relays, mutes, contacts), in a raw EVENT frame (one pass
over the text)."""
_EVENT_ID = re.compile(r'"id"\s*:\s*"([0-9a-f]{64})"')
_FRAME_HEAD = re.compile(r'\["EVENT"\s*,\s*"([^"\\]{1,64})"\s*,')
_KIND = re.compile(r'"kind"\s*:\s*(\d{1,5})\s*[,}]')
_CREATED_AT = re.compile(r'"created_at"\s*:\s*(\d{1,19})\s*[,}]')
_COPY_HEAD = re.compile(r'\["EVENT","([^"\\]{1,64})",\{"id":"([0-9a-f]{64})"')


def _stored_anyway(sub_id: str, raw: Any) -> Outcome:
    """An event this relay already delivered (or one naming nobody here) still took a place
    in its answer to a REQ: count it, or a page that the relay's limit cut short looks complete
    whenever the committer has already marked the copy from the previous page (they overlap
    at `until`). Any kind: an Iris watch's page asks for kinds no shard does (the pool counts
    a place only for a REQ still answering)."""
    if not isinstance(raw, dict):
        return Verdict.TAKEN
    created_at, kind, event_id = raw.get("created_at"), raw.get("kind"), raw.get("id")
    if type(created_at) is int and type(kind) is int and type(event_id) is str:
        return Stored(sub_id, event_id, kind, created_at)
    return Verdict.TAKEN


def _addressed(raw: Any, keys: Mapping[str, int]) -> bool:
    """Firehose, before any validation: does the frame name a key on this relay (a DM's `p`
    tag, a relay list's author)? One hash lookup per tag. A frame too odd to tell goes on to
    the full checks, which count it as malformed."""
    if not isinstance(raw, dict):
        return True
    kind = raw.get("kind")
    if type(kind) is int and kind in SUBSCRIBED_LIST_KINDS_SET:
        author = raw.get("pubkey")
        return type(author) is str and author in keys
    tags = raw.get("tags")
    if type(tags) is not list:
        return True
    for tag in tags:
        if type(tag) is list and len(tag) >= 2 and tag[0] == "p":
            value = tag[1]
            if type(value) is str and value in keys:
                return True
    return False
