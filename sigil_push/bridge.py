"""The relay bridge: relay frame → verified event → matched devices → outbox, exactly once.

Frames are parsed, checked and verified synchronously as they arrive (no event is remembered or
pushed before its id and BIP-340 signature verify), and whether an event is a pre-registration
baseline is decided right then, from the REQ it answered. Everything that needs the database
(the restart-proof dedupe, device lookup, outbox, baseline bookkeeping) happens in one committer
task that works in batches, in arrival order, so the readers never wait on the disk.

The committer has its own SQLite connection, so each batch's outbox rows and seen ids are one
transaction: after a crash either both are on disk or neither is, and a catch-up then pushes
exactly what had not been handed to the outbox. It also makes ingest fast (one commit per
batch instead of one per event). The shared outbox's `ready` is set after each commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram

from sigil_push.config import Config
from sigil_push.nostr.event import Event, InvalidEvent, compute_id
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog
from sigil_push.relays.connection import BridgeKeySigner
from sigil_push.relays.discovery import LIST_KINDS_SET, RelayLists, normalize_relay_url
from sigil_push.relays.inbox import connected_inboxes
from sigil_push.relays.pool import RelayPool
from sigil_push.relays.subscriptions import DM_KINDS, RelaySubscriptions
from sigil_push.relays.user_inbox import UserInboxes
from sigil_push.store.errors import TRANSIENT_ERRORS
from sigil_push.store.factory import connect_bridge
from sigil_push.store.interface import (
    BridgeConnection,
    Database,
    DeviceStore,
    OutboxStore,
    SeenStore,
)
from sigil_push.store.records import Device
from sigil_push.store.seen import SeenEvents
from sigil_push.supervisor import Supervisor
from sigil_push.verified import RecentlyVerified, Verified

if TYPE_CHECKING:
    from sigil_push.canary import Canary
    from sigil_push.delegated_auth import DelegatedAuth

log = logging.getLogger(__name__)

COMMIT_BATCH = 2000
CONGESTED_AT = 20_000
DRAINED_AT = 5_000
HOUSEKEEPING_SECONDS = 60.0
PRUNE_EVERY_SECONDS = 3600.0
COMMIT_ATTEMPTS = 5
INSERT_BASELINES = (
    "INSERT INTO relay_baselines (relay, pubkey, baselined_at) VALUES (?, ?, ?)"
    " ON CONFLICT DO NOTHING"
)
MAX_FUTURE_SECONDS = 15 * 60
GIFT_WRAP_LAG_SECONDS = 2 * 24 * 3600
"""NIP-59 lets a gift wrap's `created_at` lag up to two days behind its real time."""
PAST_SLACK_SECONDS = GIFT_WRAP_LAG_SECONDS + 15 * 60
RELAY_QUEUE_CAP = 2 * COMMIT_BATCH
"""A relay whose events fill this much of the commit queue waits (its reader only)."""
RECIPIENT_EVENTS_PER_SECOND = 1.0
RECIPIENT_BURST = 60.0
"""Per recipient key, across relays: a DM flood to one key (e.g. to oneself) stays that key's
cost. Twice the default per-device push rate (30 a minute): wakeups past it would only
coalesce into the same "new message" anyway."""
POISON_ATTEMPTS = 2
UNADDRESSED_FLUSH_SECONDS = 0.5
RECENTLY_VERIFIED = 10_000
"""Verified events kept by id for the copies other relays deliver (10 to 20 s at 1,000/s)."""
DROP_REASONS = (
    "malformed", "wrong_kind", "unknown_recipient", "wrong_id", "forged", "no_device",
    "too_old", "too_new", "recipient_quota", "poison", "unaddressed",
)

RECEIVED = Counter("sigil_push_bridge_events_received_total", "EVENT frames received", ["relay"])
DROPPED = Counter(
    "sigil_push_bridge_events_dropped_total", "Events dropped, by reason", ["relay", "reason"]
)
DUPLICATES = Counter(
    "sigil_push_bridge_events_duplicate_total", "Events this relay had already delivered", ["relay"]
)
BASELINED = Counter(
    "sigil_push_bridge_events_baselined_total", "Pre-registration events remembered, not pushed"
)
PUSHED = Counter("sigil_push_bridge_events_pushed_total", "Events handed to the outbox")
LATENCY = Histogram(
    "sigil_push_bridge_frame_to_outbox_seconds",
    "From frame received to its wakeups on disk in the outbox",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)
KEYS = Gauge("sigil_push_bridge_watched_keys", "Registered keys the bridge subscribes for")
COMMIT_FAILURES = Counter(
    "sigil_push_bridge_commit_failures_total", "Wakeups lost because the database refused them"
)
QUEUE = Gauge("sigil_push_bridge_commit_queue_events", "Verified events waiting for the committer")
POISON = Counter(
    "sigil_push_bridge_poison_events_total", "Events skipped after failing to commit twice"
)


CommitListener = Callable[[Sequence[tuple[str, int]]], None]
DEVICE_CACHE_SIZE = 50_000


class RelayCounters:
    """One relay's counters, bound once: label lookups per event would cost more than parsing."""

    __slots__ = ("dropped", "duplicates", "received")

    def __init__(self, url: str) -> None:
        self.received = RECEIVED.labels(url)
        self.duplicates = DUPLICATES.labels(url)
        self.dropped = {reason: DROPPED.labels(url, reason) for reason in DROP_REASONS}


def _every_key(_pubkey: str) -> bool:
    """One worker (SQLite, or before any shard is leased): the bridge watches every key."""
    return True


class DatabaseUnavailable(Exception):
    """The database stayed busy or locked through every retry (not the batch's fault)."""


class TokenBucket:
    """`rate` tokens a second up to `burst`; `take()` spends one if there is one."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, rate: float, burst: float) -> None:
        self._rate, self._burst = rate, burst
        self._tokens = burst
        self._stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def full(self) -> bool:
        """Refilled completely (so forgetting the bucket changes nothing)."""
        elapsed = time.monotonic() - self._stamp
        return self._tokens + elapsed * self._rate >= self._burst


@dataclass(slots=True)
class Arrival:
    event: Event
    relay: str
    received_ms: int
    push_to: tuple[str, ...]
    since_registration: tuple[str, ...] = ()
    """Of `push_to`, recipients whose devices wake only if the event's `created_at` is not
    before their registration: firehose events that may predate the key's first watch there."""


class Bridge:
    """Watches every relay that may carry a registered key's DMs and feeds the outbox.

    A Devices listener (`registration_changed`) and the owner of the relay pool (`on_event`,
    `baselined`); `health()` is what the API shows per relay. With `delegated_auth`, it also
    reads gated inboxes through per-user connections (`UserInboxes`, `on_user_event`).
    """

    def __init__(
        self,
        config: Config,
        devices: DeviceStore,
        outbox: OutboxStore,
        observations: ObservationLog,
        key: SecretKey,
        delegated_auth: DelegatedAuth | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._bridge = config.bridge
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        self._queued_by_relay: dict[str, int] = {}
        self._relay_drained: dict[str, asyncio.Event] = {}
        self._recipient_buckets: dict[str, TokenBucket] = {}
        self._config = config
        self._link: BridgeConnection | None = None
        self._db: Database | None = None
        self._devices = devices
        self._outbox = outbox
        self._writer: OutboxStore | None = None
        self._lists: RelayLists
        self._seen: SeenStore
        self._observations = observations
        self._insecure = config.server.allow_insecure_relays
        configured = [
            url
            for url in (normalize_relay_url(r.url, True) for r in config.relays if r.read)
            if url is not None
        ]
        modes = {
            url: relay.mode
            for url, relay in ((normalize_relay_url(r.url, True), r) for r in config.relays)
            if url is not None
        }
        self._pool = RelayPool(
            self._bridge, configured, self, BridgeKeySigner(key), observations, modes
        )
        self._recent = RecentlyVerified(RECENTLY_VERIFIED)
        self._unaddressed: dict[str, int] = {}
        self._unaddressed_flush: asyncio.TimerHandle | None = None
        self._keys: set[str] = set()
        self._queue: list[Arrival] = []
        self._db_ops: list[tuple[str, list[tuple[Any, ...]]]] = []
        self._work = asyncio.Event()
        self._drained = asyncio.Event()
        self._dirty: set[str] = set()
        self._lists_dirty: set[str] = set()
        self._registration_relays: dict[str, tuple[str, ...]] = {}
        self._user_relays: dict[str, frozenset[str]] = {}
        self._inboxes: UserInboxes | None = None
        if delegated_auth is not None:
            self._inboxes = UserInboxes(self, delegated_auth, observations, self._bridge)
            delegated_auth.add_listener(self._inboxes.session_changed)
        self._dirty_event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._commit_listeners: list[CommitListener] = []
        self._counters: dict[str, RelayCounters] = {}
        self._device_cache: dict[str, list[Device]] = {}
        self._device_generation = 0
        self._stopping = False
        self._probe: Canary | None = None
        self._owns: Callable[[str], bool] = _every_key

    # life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._link = await connect_bridge(self._config)
        self._db = self._link.db
        try:
            await self._load()
        except BaseException:
            await self._link.close()
            raise
        for name, loop in (
            ("bridge-commit", self._commit_loop),
            ("bridge-registrations", self._registration_loop),
            ("bridge-housekeeping", self._housekeeping_loop),
        ):
            self._tasks.append(self.supervisor.spawn(name, loop, core=True))
        self._apply(self._keys)
        if self._inboxes is not None:
            self._inboxes.start()
        log.info("bridge watching %d keys on %d relays", len(self._keys), len(self._pool.subs))

    async def _load(self) -> None:
        """Everything the bridge remembers, and the keys to watch, before any relay is opened."""
        db = self._db
        assert db is not None and self._link is not None
        self._writer = self._link.outbox
        self._lists = RelayLists(db, self._insecure)
        # dedupe must remember every id a catch-up can return again
        retention = max(self._bridge.seen_retention_seconds, self._bridge.catchup_seconds)
        self._seen = SeenEvents(db, retention, self._bridge.seen_cache_size)
        await self._seen.load()
        await self._lists.load()
        baselines: dict[str, set[str]] = {}
        probe = self._probe.pubkey if self._probe is not None else None
        async with db.execute("SELECT relay, pubkey FROM relay_baselines") as cursor:
            async for relay, pubkey in cursor:
                # several workers: hold only our shards' baselines (`reshard` loads the others')
                if self._owns(str(pubkey)) or pubkey == probe:
                    baselines.setdefault(str(relay), set()).add(str(pubkey))
        async with db.execute("SELECT relay, live_until FROM relay_cursors") as cursor:
            cursors = {str(relay): int(live_until) async for relay, live_until in cursor}
        self._pool.load(baselines, cursors)
        for pubkey, relays in (await self._devices.watched_keys()).items():
            if self._owns(pubkey):
                self._set_key(pubkey, relays)

    async def stop(self) -> None:
        """Close relays first, then finish what was already received, so nothing is lost."""
        if self._inboxes is not None:
            await self._inboxes.stop()
        await self._pool.stop()
        if self._unaddressed_flush is not None:
            self._unaddressed_flush.cancel()
            self._flush_unaddressed()
        self._stopping = True
        self._work.set()
        committer, *others = self._tasks
        for task in others:
            task.cancel()
        for task in others:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await committer
        await self._save_cursors()
        if self._link is not None:
            await self._link.close()

    def add_probe(self, probe: Canary) -> None:
        """Watch the canary key on its relays (before `start`). Events addressed to it alone are
        handed to `probe.take` after verification: never pushed, never recorded as seen."""
        self._probe = probe
        self._keys.add(probe.pubkey)
        self._pool.plan.set_key(probe.pubkey, probe.relays)

    def add_commit_listener(self, listener: CommitListener) -> None:
        """Be told (event id, frame received ms) of every event whose wakeups reached the outbox."""
        self._commit_listeners.append(listener)

    def registration_changed(self, pubkey: str) -> None:
        """Devices listener: re-plan this key's subscriptions soon (coalesced)."""
        self._device_cache.pop(pubkey, None)
        self._device_generation += 1
        self._dirty.add(pubkey)
        self._dirty_event.set()

    # planning ---------------------------------------------------------------------------

    def _set_key(self, pubkey: str, registration_relays: tuple[str, ...]) -> None:
        own = {
            u for u in (normalize_relay_url(r, self._insecure) for r in registration_relays) if u
        }
        listed = self._lists.relays_of(pubkey)
        inbox = listed or tuple(sorted(own))
        own.update(listed)
        self._keys.add(pubkey)
        self._user_relays[pubkey] = frozenset(own)
        self._registration_relays[pubkey] = registration_relays
        self._pool.plan.set_key(pubkey, own, inbox)

    async def _registration_loop(self) -> None:
        """Apply registration changes (re-reading the key's devices) and relay list changes
        (which need no database: a start-up with many keys brings many lists at once)."""
        while True:
            await self._dirty_event.wait()
            self._dirty_event.clear()
            pubkeys, self._dirty = self._dirty, set()
            new_lists, self._lists_dirty = self._lists_dirty - pubkeys, set()
            removed: list[str] = []
            elsewhere: set[str] = set()
            for pubkey in pubkeys:
                owned = self._owns(pubkey)
                devices = await self._devices.of_pubkey(pubkey) if owned else []
                if devices:
                    self._set_key(pubkey, tuple(r for d in devices for r in d.relays))
                else:
                    self._unwatch(pubkey)
                    if owned:
                        removed.append(pubkey)
                    else:
                        elsewhere.add(pubkey)
            for pubkey in new_lists:
                if pubkey in self._keys:
                    self._set_key(pubkey, self._registration_relays.get(pubkey, ()))
            pubkeys |= new_lists
            if removed:
                self._lists.forget(removed)
                self._db_ops.append(
                    ("DELETE FROM relay_baselines WHERE pubkey = ?", [(p,) for p in removed])
                )
                self._db_ops.append(
                    ("DELETE FROM relay_lists WHERE pubkey = ?", [(p,) for p in removed])
                )
                self._work.set()
            self._apply(pubkeys, elsewhere)

    def _unwatch(self, pubkey: str) -> None:
        self._keys.discard(pubkey)
        self._registration_relays.pop(pubkey, None)
        self._user_relays.pop(pubkey, None)
        self._pool.plan.remove_key(pubkey)

    async def reshard(self, owns: Callable[[str], bool]) -> None:
        """Watch only the registered keys `owns` accepts (this worker's key shards).

        Keys that leave are unsubscribed, their baselines kept for their new owner; keys that
        arrive first take the baselines other workers stored, so their catch-up from the
        relays' cursors pushes what arrived meanwhile instead of swallowing it as a baseline.
        """
        self._owns = owns
        db = self._db
        if db is None:  # not started yet: `_load` watches only what `owns` accepts
            return
        watched = await self._devices.watched_keys()
        probe = self._probe.pubkey if self._probe is not None else None
        arriving = {p for p in watched if owns(p) and p not in self._keys}
        leaving = {p for p in self._keys if p != probe and not owns(p)}
        if arriving:
            for relay, pubkey in await db.execute_fetchall(
                "SELECT relay, pubkey FROM relay_baselines"
            ):
                if pubkey in arriving:
                    self._pool.baselines_of(str(relay)).add(str(pubkey))
        for pubkey in arriving:
            self._set_key(pubkey, watched[pubkey])
        for pubkey in leaving:
            self._unwatch(pubkey)
        self._apply(arriving | leaving, leaving)

    def _apply(self, changed: set[str], elsewhere: Collection[str] = ()) -> None:
        """Bring connections and shards in line with the plan for the `changed` keys; the
        baselines of keys now watched `elsewhere` (another worker) stay in the database."""
        left = [(url, key) for url, key in self._pool.apply(self._keys, changed)
                if key not in elsewhere]
        if left:
            self._db_ops.append(
                ("DELETE FROM relay_baselines WHERE relay = ? AND pubkey = ?", left)
            )
            self._work.set()
        KEYS.set(len(self._keys))
        if self._inboxes is not None:
            self._inboxes.changed()

    # pool callbacks (synchronous, on the readers' tasks) ----------------------------------

    def relay_added(self, url: str) -> None:
        self._counters[url] = RelayCounters(url)

    def baselined(self, url: str, keys: frozenset[str]) -> None:
        now = int(time.time())
        self._db_ops.append((INSERT_BASELINES, [(url, pubkey, now) for pubkey in keys]))
        self._work.set()

    def relay_gated(self, url: str) -> None:
        if self._inboxes is not None:
            self._inboxes.changed()

    # per-user connections (delegated AUTH) ------------------------------------------------

    def gated_relays(self) -> set[str]:
        return set(self._pool.gated())

    def user_relays(self, pubkey: str) -> frozenset[str]:
        """The user's own DM relays (registration, kind 10050/10002), configured ones included
        only when the user lists them too: the only relays where the bridge may AUTH as them."""
        return self._user_relays.get(pubkey, frozenset())

    def baselines_of(self, url: str) -> set[str]:
        return self._pool.baselines_of(url)

    def on_user_event(
        self, url: str, pubkey: str, raw: Any, received_ms: int, baseline: bool
    ) -> None:
        """An event from `pubkey`'s own connection to a gated relay: the same checks, dedupe
        and commit path as `on_event`, pushed to that user only (it answered their REQ) and
        not at all when it predates their first subscription there (`baseline`)."""
        counters = self._counters.get(url)
        if counters is None:
            counters = self._counters[url] = RelayCounters(url)
        counters.received.inc()
        entry = self._admit(counters, url, "", raw, received_ms, lists=False)
        if entry is None:
            return
        event = entry.event
        if event.kind not in DM_KINDS:
            counters.dropped["wrong_kind"].inc()
            return
        if pubkey not in self._keys or pubkey not in event.tag_values("p"):
            counters.dropped["unknown_recipient"].inc()
            return
        self._hand_over(counters, entry, url, received_ms, () if baseline else (pubkey,))

    def on_event(self, url: str, sub_id: str, raw: Any, received_ms: int) -> None:
        """An event from the pool's connection to `url`. It may wake only keys subscribed on
        that relay (a relay cannot push keys it was never asked about; on a firehose relay
        every key there counts as subscribed). The signature is checked before any recipient
        lookup, so a forged event counts as `forged` whether or not its recipient is
        registered: public counters do not tell who is. The one lookup that comes first is the
        firehose's: an event naming no key on the relay is dropped as `unaddressed` before
        any parse or signature check, which is what makes reading every DM affordable."""
        counters = self._counters[url]
        counters.received.inc()
        subs = self._pool.subs.get(url)
        subscribed: Mapping[str, int] = subs.keys if subs is not None else {}
        if subs is not None and subs.firehose and not _addressed(raw, subscribed):
            counters.dropped["unaddressed"].inc()
            self._stored_anyway(url, sub_id, raw)
            return
        configured = self._pool.plan.is_configured(url)
        entry = self._admit(counters, url, sub_id, raw, received_ms, lists=configured)
        if entry is None:
            return
        self._route(counters, subs, url, sub_id, entry, received_ms, configured)

    def _route(
        self,
        counters: RelayCounters,
        subs: RelaySubscriptions | None,
        url: str,
        sub_id: str,
        entry: Verified,
        received_ms: int,
        configured: bool,
    ) -> None:
        """A verified event from the shared connection to `url`: to the recipients subscribed
        there, the relay lists, or the canary."""
        subscribed: Mapping[str, int] = subs.keys if subs is not None else {}
        event = entry.event
        if event.kind in DM_KINDS:
            recipients = tuple(dict.fromkeys(p for p in event.tag_values("p") if p in subscribed))
            if not recipients:
                counters.dropped["unknown_recipient"].inc()
                return
        elif event.kind in LIST_KINDS_SET and configured:
            if event.pubkey not in subscribed:
                counters.dropped["unknown_recipient"].inc()
                return
            if self._lists.offer(event):
                self._lists_dirty.add(event.pubkey)
                self._dirty_event.set()
            return
        else:
            counters.dropped["wrong_kind"].inc()
            return
        if subs is not None:
            subs.stored(sub_id, event.created_at)
        if self._probe is not None and self._probe.take(url, event):
            return
        if subs is not None and subs.firehose:
            since_registration = tuple(r for r in recipients if subs.catching_up(sub_id, r))
            self._hand_over(counters, entry, url, received_ms, recipients, since_registration)
            return
        push_to = tuple(r for r in recipients if subs is None or not subs.is_baseline(sub_id, r))
        self._hand_over(counters, entry, url, received_ms, push_to)

    def raw_event(self, url: str, frame: str, received_ms: int) -> bool:
        """A frame from the shared connection to `url`, before it is parsed; True when it was
        handled here, so it is never parsed at all:

        - on a live firehose, a frame naming no key on the relay is dropped and counted as
          `unaddressed`. The scan finds every `"p","<hex>"` pair in the raw text; in JSON
          such a pair can only be structure (quotes inside strings are escaped), so a pair
          found in the wrong place only sends the frame on to the full checks, never drops
          it. Relay lists and frames before a REQ's EOSE always take the full path;
        - a copy of an event verified moments ago (its id found in the text) is that relay's
          delivery of the verified original, exactly as in `_admit`: nothing else of the
          frame is used, so a relay that wraps a known id in another body gains only the
          record that it delivered that id.
        """
        subs = self._pool.subs.get(url)
        if subs is None or not frame.startswith('["EVENT"'):
            return False
        if subs.streaming and self._unaddressed_frame(url, frame, subs.keys):
            return True
        found = _EVENT_ID.search(frame)
        entry = self._recent.get(found.group(1)) if found is not None else None
        head = _FRAME_HEAD.match(frame) if entry is not None else None
        if entry is None or head is None:
            return False
        counters = self._counters[url]
        counters.received.inc()
        sub_id, event = head.group(1), entry.event
        if self._seen.delivered_by(event.id, url):
            counters.duplicates.inc()
            if event.kind in DM_KINDS:
                subs.stored(sub_id, event.created_at)
            return True
        configured = self._pool.plan.is_configured(url)
        self._route(counters, subs, url, sub_id, entry, received_ms, configured)
        return True

    def _unaddressed_frame(self, url: str, frame: str, keys: Mapping[str, int]) -> bool:
        for key, list_kind in _ADDRESSING.findall(frame):
            if list_kind or key in keys:
                return False
        # counted in bulk (a lock-free int now, the Prometheus counters within a second):
        # two locked increments would cost as much as the scan itself
        self._unaddressed[url] = self._unaddressed.get(url, 0) + 1
        if self._unaddressed_flush is None:
            self._unaddressed_flush = asyncio.get_running_loop().call_later(
                UNADDRESSED_FLUSH_SECONDS, self._flush_unaddressed
            )
        return True

    def _flush_unaddressed(self) -> None:
        counts, self._unaddressed = self._unaddressed, {}
        self._unaddressed_flush = None
        for url, count in counts.items():
            counters = self._counters.get(url)
            if counters is not None:
                counters.received.inc(count)
                counters.dropped["unaddressed"].inc(count)

    def _admit(
        self, counters: RelayCounters, url: str, sub_id: str, raw: Any, received_ms: int,
        lists: bool,
    ) -> Verified | None:
        """The verified event behind a frame, or None when the frame was dropped (counted), a
        repeat from this relay, or a further relay's copy of a handled event (its delivery is
        queued here). A copy of an event verified moments ago reuses that verified original:
        no parse, no signature check, and nothing of the copy's own body is used."""
        event_id = raw.get("id") if isinstance(raw, dict) else None
        if type(event_id) is str:
            if self._seen.delivered_by(event_id, url):
                counters.duplicates.inc()
                self._stored_anyway(url, sub_id, raw)
                return None
            entry = self._recent.get(event_id)
            if entry is not None:
                return entry
            if self._seen.known(event_id):
                self._handled_copy(counters, url, sub_id, raw, received_ms)
                return None
        try:
            event = Event.from_json(raw)
        except InvalidEvent:
            counters.dropped["malformed"].inc()
            return None
        is_list = event.kind in LIST_KINDS_SET
        if event.kind not in DM_KINDS and not (is_list and lists):
            counters.dropped["wrong_kind"].inc()
            return None
        if not (self._in_window(counters, event, is_list) and self._verified(counters, event)):
            return None
        return self._recent.add(event)

    def _handled_copy(
        self, counters: RelayCounters, url: str, sub_id: str, raw: Any, received_ms: int
    ) -> None:
        """A further relay's copy of an event already handled (pushed or baselined) that is no
        longer among the recently verified. It can push nothing, so only its delivery is
        recorded; its id is recomputed from its body (a hash, not a signature check: that id
        was verified when first handled), so the record carries the true kind and time."""
        try:
            event = Event.from_json(raw)
        except InvalidEvent:
            counters.dropped["malformed"].inc()
            return
        if compute_id(event.pubkey, event.created_at, event.kind, event.tags, event.content) != (
            event.id
        ):
            counters.dropped["wrong_id"].inc()
            return
        subs = self._pool.subs.get(url)
        if subs is not None:
            subs.stored(sub_id, event.created_at)
        self._enqueue(Arrival(event, url, received_ms, ()))

    def _hand_over(
        self,
        counters: RelayCounters,
        entry: Verified,
        url: str,
        received_ms: int,
        push_to: tuple[str, ...],
        since_registration: tuple[str, ...] = (),
    ) -> None:
        """Queue for the committer. Recipients' quotas are spent once per event, not once per
        relay that delivers a copy (the committer pushes an event at most once anyway)."""
        if push_to and not entry.enqueued and not self._within_quota(counters, push_to):
            return
        entry.enqueued = True
        self._enqueue(Arrival(entry.event, url, received_ms, push_to, since_registration))

    def _in_window(self, counters: RelayCounters, event: Event, is_list: bool) -> bool:
        """`created_at` within [now - catch-up - slack, now + 15 min], checked before anything
        is stored: a far-future time would overflow the database's integers or pin a relay
        list forever, an old one is a replay from past the dedupe window. Relay lists are
        long-lived replaceable events, so only their upper bound applies."""
        now = int(time.time())
        if event.created_at > now + MAX_FUTURE_SECONDS:
            counters.dropped["too_new"].inc()
            return False
        if not is_list and event.created_at < now - self._bridge.catchup_seconds - PAST_SLACK_SECONDS:
            counters.dropped["too_old"].inc()
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

    def _enqueue(self, arrival: Arrival) -> None:
        self._queue.append(arrival)
        self._queued_by_relay[arrival.relay] = self._queued_by_relay.get(arrival.relay, 0) + 1
        self._work.set()

    def _stored_anyway(self, url: str, sub_id: str, raw: Any) -> None:
        """A DM this relay already delivered still took a place in its answer to a REQ: count
        it, or a page that the relay's limit cut short looks complete whenever the committer
        has already marked the copy from the previous page (they overlap at `until`)."""
        subs = self._pool.subs.get(url)
        created_at = raw.get("created_at") if isinstance(raw, dict) else None
        if subs is not None and type(created_at) is int and raw.get("kind") in DM_KINDS:
            subs.stored(sub_id, created_at)

    @staticmethod
    def _verified(counters: RelayCounters, event: Event) -> bool:
        """Id and signature check, last because it is the costliest; failures counted by kind."""
        try:
            event.verify()
        except InvalidEvent as exc:
            counters.dropped["wrong_id" if exc.reason == "id_mismatch" else "forged"].inc()
            return False
        return True

    def congested(self, url: str) -> bool:
        """Back-pressure per relay: a relay with many events waiting pauses only its own reader
        (and every reader only when the whole queue is full)."""
        return (
            self._queued_by_relay.get(url, 0) >= RELAY_QUEUE_CAP
            or len(self._queue) >= CONGESTED_AT
        )

    async def drained(self, url: str) -> None:
        while (
            self._queued_by_relay.get(url, 0) >= RELAY_QUEUE_CAP // 2
            or len(self._queue) >= DRAINED_AT
        ):
            self._drained.clear()
            await self._drained.wait()

    # committer --------------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while self._queue or self._db_ops:
                await self._commit_pending()
            if self._stopping:
                return

    async def _commit_pending(self) -> None:
        """Commit the next batch. A batch that raises is retried once, then committed event
        by event, and an event that fails twice on its own is skipped and counted (`poison`):
        one bad input never stops the loop nor comes back forever."""
        batch, self._queue = self._queue[:COMMIT_BATCH], self._queue[COMMIT_BATCH:]
        for arrival in batch:
            left = self._queued_by_relay.get(arrival.relay, 0) - 1
            if left > 0:
                self._queued_by_relay[arrival.relay] = left
            else:
                self._queued_by_relay.pop(arrival.relay, None)
        ops: list[tuple[str, list[tuple[Any, ...]]]] = []
        if not self._queue:
            # a baseline (from an EOSE) is stored only with or after every event the relay sent
            # before that EOSE, or a crash could leave a baseline whose events were never seen
            ops, self._db_ops = self._db_ops, []
        QUEUE.set(len(self._queue))
        self._drained.set()
        try:
            for attempt in range(POISON_ATTEMPTS):
                try:
                    await self._commit_retrying(batch, ops)
                    return
                except DatabaseUnavailable:
                    raise
                except Exception as exc:  # noqa: BLE001 - a poison input: find and skip it
                    log.warning("bridge commit of %d events failed (%s), attempt %d",
                                len(batch), type(exc).__name__, attempt + 1)
            for arrival in batch:
                await self._commit_alone(arrival)
            if ops:
                await self._commit_retrying([], ops)
        except DatabaseUnavailable:
            COMMIT_FAILURES.inc(len(batch))
            log.error("could not store %d events; their wakeups are lost", len(batch))

    async def _commit_alone(self, arrival: Arrival) -> None:
        for _ in range(POISON_ATTEMPTS):
            try:
                await self._commit_retrying([arrival], [])
                return
            except DatabaseUnavailable:
                raise
            except Exception:  # noqa: BLE001, S112 - counted below once it failed twice
                continue
        POISON.inc()
        self._counters[arrival.relay].dropped["poison"].inc()
        log.error("skipped an event that failed to commit %d times", POISON_ATTEMPTS)

    async def _commit_retrying(
        self, batch: list[Arrival], ops: list[tuple[str, list[tuple[Any, ...]]]]
    ) -> None:
        """`_commit`, retried with backoff while the database is busy or locked."""
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                await self._commit(batch, ops)
                return
            except TRANSIENT_ERRORS as exc:
                log.warning("bridge commit failed (%s: %s), attempt %d",
                            type(exc).__name__, exc, attempt + 1)
                await asyncio.sleep(0.1 * 2**attempt)
        raise DatabaseUnavailable

    async def _commit(
        self, batch: list[Arrival], ops: list[tuple[str, list[tuple[Any, ...]]]]
    ) -> None:
        """Decide, write, and only then remember the batch's ids as seen."""
        new_events, further, to_push, decided = await self._decide(batch)
        writes = await self._targets(to_push)
        await self._write(writes, new_events, further, ops)
        self._seen.remember(decided)
        await self._lists.save()
        if writes:
            self._outbox.ready.set()
            now = time.time()
            committed = [(arrival.event.id, arrival.received_ms) for arrival, _ in writes]
            for arrival, _ in writes:
                LATENCY.observe(max(0.0, now - arrival.received_ms / 1000))
            PUSHED.inc(len(writes))
            for listener in self._commit_listeners:
                listener(committed)

    async def _decide(self, batch: list[Arrival]) -> tuple[
        list[tuple[str, str, int, int]], list[tuple[str, str, int]], list[Arrival],
        dict[str, tuple[str, ...]],
    ]:
        """Which arrivals are new events, deliveries by a further relay, and wanted pushes;
        and the deliveries to remember once they are on disk (not before: a failed write
        must not make them look handled)."""
        await self._seen.lookup(a.event.id for a in batch if not self._seen.known(a.event.id))
        new_events: list[tuple[str, str, int, int]] = []
        further: list[tuple[str, str, int]] = []
        to_push: list[Arrival] = []
        decided: dict[str, tuple[str, ...]] = {}
        for arrival in batch:
            event = arrival.event
            is_new, first_here = self._seen.first_delivery(event.id, arrival.relay, decided)
            if not first_here:
                self._counters[arrival.relay].duplicates.inc()
                continue
            self._observations.seen(
                arrival.relay, event.id, event.kind, event.created_at, arrival.received_ms
            )
            if not is_new:
                further.append((event.id, arrival.relay, event.created_at))
                continue
            new_events.append((event.id, arrival.relay, arrival.received_ms, event.created_at))
            if arrival.push_to:
                to_push.append(arrival)
                self._expect(arrival)
            else:
                BASELINED.inc()
        return new_events, further, to_push, decided

    def _expect(self, arrival: Arrival) -> None:
        """Observation: the recipients' inbox relays that were connected as their DM arrived."""
        relays = connected_inboxes(
            arrival.push_to, self._lists, self._registration_relays, self._insecure,
            self._pool.connected,
        )
        self._observations.expect(arrival.received_ms, arrival.event.id, relays)

    async def _targets(self, arrivals: list[Arrival]) -> list[tuple[Arrival, list[Device]]]:
        """The devices each event wakes: its recipients' devices registered before it arrived."""
        if not arrivals:
            return []
        by_key = await self._devices_of(dict.fromkeys(r for a in arrivals for r in a.push_to))
        writes = []
        for arrival in arrivals:
            late = arrival.since_registration
            targets = [
                device
                for recipient in arrival.push_to
                for device in by_key.get(recipient, ())
                if device.registered_at * 1000 <= arrival.received_ms
                and (recipient not in late or device.registered_at <= arrival.event.created_at)
            ]
            if targets:
                writes.append((arrival, targets))
            elif late:
                BASELINED.inc()
            else:
                self._counters[arrival.relay].dropped["no_device"].inc()
        return writes

    async def _devices_of(self, recipients: Iterable[str]) -> dict[str, list[Device]]:
        """Devices by recipient, from a cache that registration changes invalidate."""
        cache = self._device_cache
        missing = [r for r in recipients if r not in cache]
        if missing:
            generation = self._device_generation
            found: dict[str, list[Device]] = {r: [] for r in missing}
            for device in await self._devices.of_pubkeys(missing):
                found[device.pubkey].append(device)
            if generation == self._device_generation:
                if len(cache) + len(found) > DEVICE_CACHE_SIZE:
                    cache.clear()
                cache.update(found)
            else:
                return found | {r: cache[r] for r in recipients if r in cache}
        return cache

    async def _write(
        self,
        writes: list[tuple[Arrival, list[Device]]],
        new_events: list[tuple[str, str, int, int]],
        further: list[tuple[str, str, int]],
        ops: list[tuple[str, list[tuple[Any, ...]]]],
    ) -> None:
        """One transaction: the batch's wakeups, its seen ids, and the queued bookkeeping."""
        db, writer = self._db, self._writer
        assert db is not None and writer is not None
        await db.execute("BEGIN IMMEDIATE")
        try:
            await writer.enqueue_many(
                [(a.event, a.relay, a.received_ms, targets) for a, targets in writes]
            )
            await self._seen.save(new_events, further)
            for sql, rows in ops:
                await db.executemany(sql, rows)
            await db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await db.execute("ROLLBACK")
            raise

    # housekeeping -----------------------------------------------------------------------

    async def _housekeeping_loop(self) -> None:
        last_prune = 0.0
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            self._pool.note_live()
            await self._save_cursors()
            self._recipient_buckets = {
                key: bucket for key, bucket in self._recipient_buckets.items() if not bucket.full()
            }
            if time.monotonic() - last_prune >= PRUNE_EVERY_SECONDS:
                last_prune = time.monotonic()
                removed = await self._seen.prune()
                log.info("forgot %d event ids past retention", removed)

    async def _save_cursors(self) -> None:
        if self._pool.cursors and self._db is not None:
            await self._db.executemany(
                "INSERT INTO relay_cursors (relay, live_until) VALUES (?, ?)"
                " ON CONFLICT (relay) DO UPDATE SET live_until = excluded.live_until",
                list(self._pool.cursors.items()),
            )

    def health(self) -> dict[str, dict[str, Any]]:
        """Per relay: the contract's `connected`/`last_event_at` plus the bridge's own detail,
        including, for gated relays, how many users' delegated AUTH works or fails there."""
        report = self._pool.health()
        users = self._inboxes.health() if self._inboxes is not None else {}
        for url, entry in report.items():
            entry.update(users.get(url, {"users_authenticated": 0, "users_failed": 0}))
        return report


_ADDRESSING = re.compile(r'"p"\s*,\s*"([0-9a-f]{64})"|"kind"\s*:\s*(10050|10002)\b')
"""A `p` tag's key, or a relay-list kind, in a raw EVENT frame (one pass over the text)."""
_EVENT_ID = re.compile(r'"id"\s*:\s*"([0-9a-f]{64})"')
_FRAME_HEAD = re.compile(r'\["EVENT"\s*,\s*"([^"\\]{1,64})"\s*,')


def _addressed(raw: Any, keys: Mapping[str, int]) -> bool:
    """Firehose, before any validation: does the frame name a key on this relay (a DM's `p`
    tag, a relay list's author)? One hash lookup per tag. A frame too odd to tell goes on to
    the full checks, which count it as malformed."""
    if not isinstance(raw, dict):
        return True
    kind = raw.get("kind")
    if type(kind) is int and kind in LIST_KINDS_SET:
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
