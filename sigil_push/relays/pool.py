"""Which relays to watch for which keys, within the cap on connections, and the pool of
connections that carries them.

Configured relays carry every key. A user's own relays (registration `relays`, kind 10050 or
10002 lists) carry only that user's keys; one connection per relay is shared by all keys that
want it. When more relays are wanted than `max_relays` allows, the rest are reported as skipped
instead of silently ignored, and the choice is fair rather than first come, first served
(`RelayPlan.choose`): each key counts for at most MAX_RELAYS_PER_KEY relays, a relay that is
some key's only inbox is served first in the order those keys arrived (never by how many keys
name it), every key's inbox is served before any extra relay, and a key contributes one vote to
the next tier, so throwaway keys, however many and whatever URLs they agree on, cannot push an
older real user's only inbox relay out.

A configured relay is read in firehose mode (one REQ for every DM, no `#p`) when its `mode` is
"firehose", or "auto" with more than `bridge.firehose_above_keys` keys; users' own relays are
always filtered (small inboxes: naming the few keys there is cheaper than reading everything).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from prometheus_client import Counter, Gauge

from sigil_push.config import BridgeConfig
from sigil_push.observations import ObservationLog
from sigil_push.relays import catchup_metrics
from sigil_push.relays.connection import BACKOFF, CONNECTED, GATED, AuthSigner, RelayConnection
from sigil_push.relays.labels import USER_RELAYS, configure_relays, series_label
from sigil_push.relays.nip77 import NegentropyFailed, Reconciler
from sigil_push.relays.port import BridgePort, Frame, RelayFeed, Stored, Verdict
from sigil_push.relays.subscriptions import RelaySubscriptions, Request
from sigil_push.relays.watch_requests import RelayWatches, WatchPlan
from sigil_push.supervisor import BackgroundTasks
from sigil_push.telemetry.memory_gauges import track

log = logging.getLogger(__name__)

_SUB_ID = re.compile(r'\["EVENT"\s*,\s*"([^"\\]{1,64})"')
GIFT_WRAP_SKEW_SECONDS = 2 * 24 * 3600
CURSOR_MARGIN_SECONDS = 600
NEGENTROPY_RETRY_SECONDS = 6 * 3600.0
"""A relay that failed NIP-77 is caught up by paged REQ, and tried again after this long."""
MAX_RELAYS_PER_KEY = 20
"""User relays one npub can make the bridge watch, across all its devices and lists."""
NO_RELAYS: frozenset[str] = frozenset()
"""The user relays of a key that has none (most keys): shared, never one set per key."""

SKIPPED = Gauge("sigil_push_relay_skipped_relays", "User relays not watched because of max_relays")
WATCHED = Gauge("sigil_push_relay_watched_relays", "Relays the bridge keeps a connection to")
REPLANS = Counter(
    "sigil_push_relay_replans_total",
    "Times the relays to watch were chosen again, every key's relays ranked",
)
UNSUBSCRIBED = Gauge(
    "sigil_push_relay_unsubscribed_keys",
    "Keys left out on a relay because its NIP-11 limits leave no room for them",
    ["relay"],
)


class RelayPlan:
    """Pure bookkeeping of key → user relays and the resulting relay choice (no I/O)."""

    def __init__(self, configured: Sequence[str], max_relays: int) -> None:
        self.configured: tuple[str, ...] = tuple(dict.fromkeys(configured))
        self._configured_set = frozenset(self.configured)
        self._max_relays = max_relays
        self.own_relays: dict[str, frozenset[str]] = {}
        self.demand: dict[str, set[str]] = {}
        self.inbox: dict[str, tuple[str, ...]] = {}
        self._inbox_demand: dict[str, int] = {}
        self._seniority: dict[str, int] = {}
        """Per key with an inbox: when it got one in this process (a sequence number; lower is
        older). At start keys come in the store's order (registration order on SQLite, shard
        by shard on PostgreSQL), so across restarts this is approximate seniority."""
        self._next_seniority = 0
        self.skipped: dict[str, int] = {}
        self.kinds: dict[str, frozenset[int]] = {}
        """Each key's public kinds (issue 32: mentions, reposts, reactions, zaps), for the keys
        that want any; every relay's REQs ask for those of their keys (`RelaySubscriptions`)."""
        SKIPPED.set(0)
        WATCHED.set(0)

    def is_configured(self, url: str) -> bool:
        return url in self._configured_set

    def set_kinds(self, pubkey: str, kinds: frozenset[int]) -> None:
        """The public kinds `pubkey`'s pairs want (empty: DMs only); the relays take them up
        as the key is applied (`RelayPool.apply`)."""
        if kinds:
            self.kinds[pubkey] = kinds
        else:
            self.kinds.pop(pubkey, None)

    def set_key(self, pubkey: str, relays: Iterable[str], inbox: Iterable[str] = ()) -> None:
        """`relays`: every relay the key wants watched; `inbox`: those of them where its DMs
        arrive (kind 10050 list, else registration relays), ranked first and kept first when
        the key names more than MAX_RELAYS_PER_KEY.

        Only keys with relays of their own have entries in `own_relays` and `inbox`: most keys
        have none, and an empty frozenset each (216 bytes) was most of a million keys' memory.
        """
        inbox_list = [u for u in dict.fromkeys(inbox) if u not in self._configured_set]
        rest = sorted(set(relays) - self._configured_set - set(inbox_list))
        kept = (inbox_list + rest)[:MAX_RELAYS_PER_KEY]
        wanted = frozenset(kept) if kept else NO_RELAYS
        before = self.own_relays.get(pubkey, NO_RELAYS)
        if not wanted and not before:
            return
        for url in before - wanted:
            holders = self.demand.get(url)
            if holders is not None:
                holders.discard(pubkey)
                if not holders:
                    del self.demand[url]
        for url in wanted - before:
            self.demand.setdefault(url, set()).add(pubkey)
        for url in self.inbox.pop(pubkey, ()):
            left = self._inbox_demand[url] - 1
            if left:
                self._inbox_demand[url] = left
            else:
                del self._inbox_demand[url]
        if not wanted:
            del self.own_relays[pubkey]
            self._seniority.pop(pubkey, None)
            return
        self.own_relays[pubkey] = wanted
        inbox_here = tuple(u for u in inbox_list if u in wanted)
        if not inbox_here:
            self._seniority.pop(pubkey, None)
        if inbox_here:
            if pubkey not in self._seniority:
                self._seniority[pubkey] = self._next_seniority
                self._next_seniority += 1
            self.inbox[pubkey] = inbox_here
            for url in inbox_here:
                self._inbox_demand[url] = self._inbox_demand.get(url, 0) + 1

    def remove_key(self, pubkey: str) -> None:
        self.set_key(pubkey, ())

    def _ranked(self) -> list[str]:
        """User relays in the order they get slots.

        0. Sole inboxes: a relay that is some key's only inbox, in the order the oldest such
           key got it (seniority), then by URL. Votes do not count here: throwaway keys are
           free to make, so a relay named by a hundred of them is worth no more than a real
           user's only way in, and keys arriving after that user can never outrank it.
        1. One relay per other key with an inbox (one not already served by tier 0): its
           inbox relay wanted by the most keys. Relays are ordered by how many keys they
           cover this way, then by how few inbox relays those keys have, then by the seniority
           of their oldest such key, then by URL. A key casts one vote here however many URLs
           it names, so it cannot outvote another key with its own extra URLs.
        2. The other inbox relays, by how many keys list them as inbox.
        3. Every other relay, by how many keys want it.
        """
        inbox_demand = self._inbox_demand
        seniority = self._seniority
        sole: dict[str, int] = {}
        for pubkey, urls in self.inbox.items():
            if len(urls) == 1:
                url = urls[0]
                sole[url] = min(sole.get(url, seniority[pubkey]), seniority[pubkey])
        tier0 = sorted(sole, key=lambda u: (sole[u], u))
        votes: dict[str, int] = {}
        tightest: dict[str, int] = {}
        oldest: dict[str, int] = {}
        for pubkey, urls in self.inbox.items():
            if not urls or any(u in sole for u in urls):
                continue
            pick = min(urls, key=lambda u: (-inbox_demand[u], u))
            votes[pick] = votes.get(pick, 0) + 1
            tightest[pick] = min(tightest.get(pick, len(urls)), len(urls))
            oldest[pick] = min(oldest.get(pick, seniority[pubkey]), seniority[pubkey])
        first = tier0 + sorted(votes, key=lambda u: (-votes[u], tightest[u], oldest[u], u))
        chosen = set(first)
        second = sorted((u for u in inbox_demand if u not in chosen),
                        key=lambda u: (-inbox_demand[u], u))
        chosen.update(second)
        third = sorted((u for u in self.demand if u not in chosen),
                       key=lambda u: (-len(self.demand[u]), u))
        return first + second + third

    def choose(self) -> list[str]:
        """Configured relays first, then user relays in `_ranked` order up to `max_relays`."""
        room = max(0, self._max_relays - len(self.configured))
        ranked = self._ranked()
        chosen = list(self.configured) + ranked[:room]
        REPLANS.inc()
        self.skipped = {url: len(self.demand[url]) for url in ranked[room:]}
        SKIPPED.set(len(self.skipped))
        WATCHED.set(len(chosen))
        return chosen

    def keys_on(self, url: str, all_keys: set[str]) -> set[str]:
        return all_keys if url in self._configured_set else self.demand.get(url, set())


class _NoSubscriptions:
    """The subscription context of a relay the pool no longer holds (its last frames still
    arrive while it closes): no keys there, so ingest wakes nobody from it."""

    keys: Mapping[str, int] = MappingProxyType({})
    firehose = False
    streaming = False

    def is_baseline(self, sub_id: str, recipient: str) -> bool:
        return False

    def catching_up(self, sub_id: str, recipient: str) -> bool:
        return False

    def answering(self, sub_id: str) -> bool:
        return False


NO_SUBSCRIPTIONS = _NoSubscriptions()


class RelayPool:
    """The open connections and their shards, kept in line with a RelayPlan.

    It is every connection's handler: it (re)sends REQs when a connection opens, after AUTH and
    when keys change, pages and baselines at EOSE, and hands each EVENT frame to ingest as a
    `Frame` carrying its relay's `RelayFeed`, applying the verdict it gets back. What it reports
    goes through the bridge's port, the one way up.
    """

    def __init__(
        self,
        settings: BridgeConfig,
        plan: RelayPlan,
        watch_plan: WatchPlan,
        signer: AuthSigner,
        observations: ObservationLog,
        port: BridgePort,
        modes: dict[str, str] | None = None,
    ) -> None:
        """`plan` is which relays carry which keys (the key registry keeps it), `watch_plan`
        what the configured relays are asked for beside the keys' shards (the Iris watches keep
        it; the pool re-asks when it changes); `port` is where frames, baselines, gated relays
        and back-pressure go, and where catch-up items come from."""
        self._settings = settings
        self._modes = modes or {}
        self.plan = plan
        self._port = port
        self._signer = signer
        self._observations = observations
        self.subs: dict[str, RelaySubscriptions] = {}
        self._feeds: dict[str, RelayFeed] = {}
        self._connections: dict[str, RelayConnection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._baselines: dict[str, set[str]] = {}
        self.cursors: dict[str, int] = {}
        self._retired_cursors: dict[str, int] = {}
        """Cursors of relays dropped since the last save (`cursors_to_save`), then forgotten."""
        self._background = BackgroundTasks("relay-pool")
        self._maybe_gated: set[str] = set()
        self._chosen: list[str] | None = None
        self.negentropy_support: dict[str, bool] = {}
        """What trying NIP-77 taught per relay (absent: not tried yet)."""
        self._negentropy_retry: dict[str, float] = {}
        self._reconcilers: dict[str, Reconciler] = {}
        self._reconcile_locks: dict[str, asyncio.Lock] = {}
        self._reconcile_tasks: dict[str, asyncio.Task[Any]] = {}
        self.watch_plan = watch_plan
        """Keys of indexed watches (Iris subscriptions), asked on every configured relay."""
        watch_plan.add_listener(self.watches_changed)
        self._watches: dict[str, RelayWatches] = {}
        self.follows: set[str] = set()
        """Watched keys with a follows-only pair: only their kind 3 is asked for (`set_follows`)."""
        track("relay_baselines", self, lambda p: sum(len(k) for k in p._baselines.values()))
        track("relay_cursors", self, lambda p: len(p.cursors))
        track("relay_plan_keys", self, lambda p: len(p.plan.own_relays))
        track("negentropy_support", self, lambda p: len(p.negentropy_support))
        configure_relays(self.plan.configured)
        self._bind_user_series()

    def _bind_user_series(self) -> None:
        """The USER_RELAYS series of the per-relay gauges, summed over the user relays in use
        at scrape time (each relay's own value has no label of its own to go to): how many are
        connected, gated, the longest backoff, keys left unsubscribed, pages waiting. Read
        through a weak reference, like memory_gauges.track."""
        reference = weakref.ref(self)

        def over_user_relays(
            value: Callable[[RelayPool, str], float],
            combine: Callable[[Iterable[float]], float] = sum,
        ) -> Callable[[], float]:
            def read() -> float:
                pool = reference()
                if pool is None:
                    return 0.0
                return combine([0.0, *(
                    value(pool, url) for url in pool._connections
                    if not pool.plan.is_configured(url)
                )])
            return read

        def backoff(pool: RelayPool, url: str) -> float:
            until = pool._connections[url].backoff_until
            return 0.0 if until is None else max(0.0, until - time.time())

        catchup_metrics.bind(USER_RELAYS)
        CONNECTED.labels(USER_RELAYS).set_function(
            over_user_relays(lambda p, u: float(p._connections[u].connected)))
        GATED.labels(USER_RELAYS).set_function(
            over_user_relays(lambda p, u: float(p._connections[u].gated_reason is not None)))
        BACKOFF.labels(USER_RELAYS).set_function(over_user_relays(backoff, max))
        UNSUBSCRIBED.labels(USER_RELAYS).set_function(
            over_user_relays(lambda p, u: float(len(p.subs[u].overflow))))
        catchup_metrics.PAGES_WAITING.labels(USER_RELAYS).set_function(
            over_user_relays(lambda p, u: float(p.subs[u].pages_waiting)))

    def load(self, baselines: dict[str, set[str]], cursors: dict[str, int]) -> None:
        self._baselines = baselines
        self.cursors = cursors

    def apply(
        self, keys: set[str], changed: Iterable[str], replan: bool = True, opening: bool = True
    ) -> list[tuple[str, str]]:
        """Open, close and re-shard after `changed` keys moved; returns the (relay, key) pairs
        whose baseline is void because the key left that relay.

        Without `replan`, the relays chosen last time stay (no relay opens or closes): a
        reshard applies many chunks of keys and chooses once at the end, as choosing ranks
        every key's relays. Without `opening`, a relay opened now starts with none of its keys
        (its mode chosen for all of them), for the caller to add them as `changed` chunks."""
        if replan or self._chosen is None:
            self._chosen = self.plan.choose()
        chosen = self._chosen
        for url in [u for u in self.subs if u not in chosen]:
            self._drop(url)
        left: list[tuple[str, str]] = []
        for url in chosen:
            keys_here = self.plan.keys_on(url, keys)
            firehose = self.firehose_wanted(url, len(keys_here))
            subs = self.subs.get(url)
            if subs is None:
                subs = self._open(url)
                subs.set_firehose(firehose)
                if opening:
                    for pubkey in keys_here:
                        subs.add(pubkey)
                continue
            touched = subs.set_firehose(firehose)
            for pubkey in changed:
                if pubkey in keys_here:
                    if pubkey not in subs.keys and pubkey not in subs.overflow:
                        subs.add(pubkey)
                        touched = True
                    elif subs.touch(pubkey):
                        touched = True
                elif pubkey in subs.keys or pubkey in subs.overflow:
                    subs.remove(pubkey)
                    left.append((url, pubkey))
                    touched = True
            newly = subs.take_newly_baselined()
            if newly:
                self._port.baselines.baselined(url, newly)
            if touched:
                self._spawn(self._sync(url))
        self._forget_unused()
        return left

    def set_follows(self, pubkey: str, follows: bool) -> None:
        """Whether `pubkey` has a follows-only pair (its kind 3 is read only then): the
        configured relays that hold it re-ask its shard, and fetch its kind 3 if it just
        turned follows-only. Nothing else is re-planned: no relay opens or closes."""
        if follows == (pubkey in self.follows):
            return
        if follows:
            self.follows.add(pubkey)
        else:
            self.follows.discard(pubkey)
        for url in self.plan.configured:
            subs = self.subs.get(url)
            if subs is not None and subs.contacts_changed(pubkey, follows):
                self._spawn(self._sync(url))

    def _forget_unused(self) -> None:
        """Baselines and cursors of relays not in use leave memory (at start every stored
        relay's are loaded; `adopt` brings others' keys on every relay). The store keeps them:
        a user relay that comes back reads its own (`_restore_then_start`)."""
        for url in [u for u in self._baselines if u not in self.subs]:
            del self._baselines[url]
        for url in [u for u in self.cursors if u not in self.subs]:
            del self.cursors[url]

    def cursors_to_save(self) -> list[tuple[str, int]]:
        """The cursors to store, in relay order: those of the relays in use and of the relays
        dropped since the last call (forgotten from here on)."""
        rows = {**self._retired_cursors, **self.cursors}
        self._retired_cursors = {}
        return sorted(rows.items())

    def firehose_wanted(self, url: str, keys: int) -> bool:
        """Firehose for a configured relay in mode "firehose", or "auto" past the threshold."""
        if not self.plan.is_configured(url):
            return False
        mode = self._modes.get(url, "auto")
        return mode == "firehose" or (
            mode == "auto" and keys > self._settings.firehose_above_keys
        )

    def _open(self, url: str) -> RelaySubscriptions:
        # state still in memory (loaded at start, or never freed): nothing to read back
        in_memory = url in self._baselines or url in self.cursors
        subs = RelaySubscriptions(
            self._settings.keys_per_filter,
            with_lists=self.plan.is_configured(url),
            baselined=self._baselines.setdefault(url, set()),
            wants=self.plan.kinds,
            stale_after=self._settings.stale_after_seconds,
            follows=self.follows,
        )
        self.subs[url] = subs
        if self.plan.is_configured(url):
            watches = self._watches[url] = RelayWatches(
                self.watch_plan, self._settings.keys_per_filter,
                self._settings.stale_after_seconds, self._settings.catchup_seconds,
            )
            subs.watch_pages = watches.pages
        feed = self._feeds[url] = RelayFeed(url, self.plan.is_configured(url), subs)
        self._locks[url] = asyncio.Lock()
        connection = RelayConnection(
            url,
            self,
            self._signer,
            self._observations,
            self._settings.reconnect_min_seconds,
            self._settings.reconnect_max_seconds,
            max_frame_bytes=self._settings.max_frame_bytes,
            skip_event=lambda text, received_ms: self._text(feed, text, received_ms),
            heartbeat_seconds=self._settings.relay_heartbeat_seconds,
            open_timeout_seconds=self._settings.relay_open_timeout_seconds,
        )
        self._connections[url] = connection
        if self.plan.is_configured(url):
            UNSUBSCRIBED.labels(series_label(url)).set(0)
            catchup_metrics.bind(series_label(url))
        self._port.ingest.relay_added(url, connection.budget)
        if self.plan.is_configured(url) or in_memory:
            connection.start()  # a configured relay is never dropped: loaded at start
        else:
            self._spawn(self._restore_then_start(url, connection))
        return subs

    async def _restore_then_start(self, url: str, connection: RelayConnection) -> None:
        """A user relay opened after start may have been used before (and dropped, its state
        freed): read its keys' stored baselines and its cursor before the first REQ, so it
        catches up from where it was instead of baselining its keys anew."""
        try:
            keys = sorted(self.plan.demand.get(url, ()))
            baselined, cursor = await self._port.baselines.stored_relay_state(url, keys)
            subs = self.subs.get(url)
            if subs is None or self._connections.get(url) is not connection:
                return
            subs.baselined.update(baselined)
            known = [c for c in (cursor, self._retired_cursors.get(url)) if c is not None]
            if known and url not in self.cursors:
                self.cursors[url] = max(known)
        finally:
            if self._connections.get(url) is connection:
                connection.start()

    def _drop(self, url: str) -> None:
        self.subs.pop(url, None)
        self._watches.pop(url, None)
        self._feeds.pop(url, None)
        self._locks.pop(url, None)
        self._maybe_gated.discard(url)
        self._reconcilers.pop(url, None)
        self._reconcile_locks.pop(url, None)
        connection = self._connections.pop(url, None)
        # per-relay state goes with the relay (URLs churn); baselines and cursors stay in the
        # store (the cursor once saved), so a relay that comes back catches up from where it was
        self._baselines.pop(url, None)
        cursor = self.cursors.pop(url, None)
        if cursor is not None:
            self._retired_cursors[url] = cursor
        self.negentropy_support.pop(url, None)
        self._negentropy_retry.pop(url, None)
        # (user relays share one label, USER_RELAYS, which stays)
        if self.plan.is_configured(url):
            with contextlib.suppress(KeyError):
                UNSUBSCRIBED.remove(series_label(url))
            catchup_metrics.unbind(series_label(url))
        self._port.ingest.relay_removed(url)
        if connection is not None:
            self._spawn(connection.stop())

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self._connections.values()))
        running = self._background.running()
        self._background.cancel()
        # a reconciliation cut short closes its nostr-sdk client on the way out
        await asyncio.gather(*running, return_exceptions=True)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self._background.spawn(coroutine)

    def _since(self, url: str) -> tuple[int, int, int]:
        """(window for fresh keys, window for a catch-up of baselined keys, the oldest list a
        shard's REQ asks for). Lists carry no gift wrap's skewed time: the relay's cursor (the
        time its REQs were last all live; now, before it has one) less the margin; a key's
        older lists come in the whole-list fetch made when it is added."""
        now = int(time.time())
        full = now - self._settings.catchup_seconds
        cursor = self.cursors.get(url)
        lists = min(now, now if cursor is None else cursor) - CURSOR_MARGIN_SECONDS
        if cursor is None:
            return full, full, lists
        return full, max(full, cursor - GIFT_WRAP_SKEW_SECONDS - CURSOR_MARGIN_SECONDS), lists

    async def _sync(self, url: str) -> None:
        """Send the REQ/CLOSE frames that bring the relay's shards up to date."""
        lock, subs = self._locks.get(url), self.subs.get(url)
        connection = self._connections.get(url)
        if lock is None or subs is None or connection is None:
            return
        async with lock:
            if not connection.connected:
                return
            subs.negentropy = self._negentropy_allowed(url)
            reconcile = False
            since_full, since_caught_up, lists_since = self._since(url)
            for request in subs.due(since_full, since_caught_up, lists_since):
                await _send_request(connection, request)
                reconcile = reconcile or request.reconcile
            watches = self._watches.get(url)
            if watches is not None:
                requests = watches.due(since_caught_up, subs.firehose, lists_since)
                for request in requests:
                    await _send_request(connection, request)
                pages = sum(1 for request in requests if request.page)
                if pages:
                    catchup_metrics.PAGES.labels(series_label(url)).inc(pages)
            if self.plan.is_configured(url):
                UNSUBSCRIBED.labels(series_label(url)).set(len(subs.overflow))
        if reconcile:
            self._spawn(self._reconcile(url))

    def _negentropy_allowed(self, url: str) -> bool:
        """Try NIP-77 unless the relay failed it less than NEGENTROPY_RETRY_SECONDS ago."""
        if not self._settings.negentropy:
            return False
        if self.negentropy_support.get(url, True):
            return True
        return time.monotonic() >= self._negentropy_retry.get(url, 0.0)

    async def _reconcile(self, url: str) -> None:
        """Catch up, one shard at a time, every shard of `url` waiting for negentropy: the
        relay's ids for the shard's window beyond those it delivered before (from the store),
        then fetched by id on the shared connection. A failure falls back to paged REQ for
        the shard and marks the relay for a retry later; a shard re-requested meanwhile (or a
        connection lost) is skipped, its new REQ has its own catch-up."""
        lock = self._reconcile_locks.setdefault(url, asyncio.Lock())
        async with lock:
            reconciler = self._reconcilers.setdefault(url, Reconciler(url))
            task = asyncio.current_task()
            if task is not None:
                self._reconcile_tasks[url] = task
            try:
                while True:
                    subs = self.subs.get(url)
                    waiting = subs.reconciling() if subs is not None else []
                    if subs is None or not waiting:
                        return
                    for shard, sub_id in waiting:
                        await self._reconcile_shard(url, subs, reconciler, shard, sub_id)
            finally:
                self._reconcile_tasks.pop(url, None)
                await reconciler.close()

    async def _reconcile_shard(
        self, url: str, subs: RelaySubscriptions, reconciler: Reconciler, shard: int,
        sub_id: str,
    ) -> None:
        target = subs.reconcile_target(shard, sub_id)
        if target is None:
            return
        keys, parts = target
        before = reconciler.count.bytes
        try:
            missing: list[str] = []
            for kinds, since in parts:
                # one reconciliation per part: the DMs' window and the public kinds' (shorter)
                query: dict[str, Any] = {"kinds": list(kinds), "since": since}
                if keys is not None:
                    query["#p"] = keys
                base, items = await self._port.catchup.held(url, keys, since)
                missing.extend(await reconciler.missing(query, items, base))
        except NegentropyFailed as failure:
            if failure.reason != "error":
                self.negentropy_support[url] = False
                self._negentropy_retry[url] = time.monotonic() + NEGENTROPY_RETRY_SECONDS
            catchup_metrics.FALLBACKS.labels(series_label(url), failure.reason).inc()
            follow_ups = subs.fell_back(shard, sub_id)
        else:
            self.negentropy_support[url] = True
            catchup_metrics.RUNS.labels(series_label(url), "negentropy").inc()
            follow_ups = subs.reconciled(shard, sub_id, missing)
        finally:
            catchup_metrics.BYTES.labels(series_label(url), "negentropy").inc(reconciler.count.bytes - before)
        if follow_ups:
            await self._send(url, follow_ups)
        elif self._live(url, subs):
            self.cursors[url] = int(time.time())

    async def _send(self, url: str, requests: list[Request]) -> None:
        lock, connection = self._locks.get(url), self._connections.get(url)
        if lock is not None and connection is not None:
            async with lock:
                for request in requests:
                    await _send_request(connection, request)
        pages = sum(1 for request in requests if request.page)
        if pages:
            catchup_metrics.PAGES.labels(series_label(url)).inc(pages)

    def _catchup_counts(self, url: str, subs: RelaySubscriptions) -> None:
        """Hand the shard bookkeeping's catch-up counts to the metrics."""
        for method, count in subs.fetched.items():
            if count:
                catchup_metrics.EVENTS.labels(series_label(url), method).inc(count)
                subs.fetched[method] = 0
        if subs.finished["req"]:
            catchup_metrics.RUNS.labels(series_label(url), "req").inc(subs.finished["req"])
            subs.finished["req"] = 0
        capped = subs.take_capped()
        if capped:
            catchup_metrics.PAGE_CAP.labels(series_label(url)).inc(capped)
        if self.plan.is_configured(url):
            catchup_metrics.PAGES_WAITING.labels(series_label(url)).set(subs.pages_waiting)

    def _watch_counts(self, url: str, watches: RelayWatches) -> None:
        """Hand the watch catch-up's counts to the metrics (method `req`: paged REQ)."""
        fetched = watches.take_fetched()
        if fetched:
            catchup_metrics.EVENTS.labels(series_label(url), "req").inc(fetched)
        capped = watches.take_capped()
        if capped:
            catchup_metrics.PAGE_CAP.labels(series_label(url)).inc(capped)

    def connected(self, url: str) -> bool:
        """Whether the shared connection to `url` is open right now."""
        connection = self._connections.get(url)
        return connection is not None and connection.connected

    def gated(self) -> dict[str, str]:
        """The relays where the shared connection cannot read users' DMs, with the reason:
        refused even after AUTH, or `maybe_gated` (served nothing, as nip42_dms relays do);
        delegated AUTH opens per-user connections on both."""
        gated = {url: c.gated_reason for url, c in self._connections.items() if c.gated_reason}
        for url in self._maybe_gated:
            gated.setdefault(url, "maybe_gated")
        return gated

    def baselines_of(self, url: str) -> set[str]:
        """The live set of keys baselined on `url` (shared with its RelaySubscriptions), so a
        per-user connection and the shared one agree on which events predate a registration."""
        return self._baselines.setdefault(url, set())

    def note_live(self) -> None:
        """Advance the cursor of every relay whose subscriptions are all past EOSE."""
        now = int(time.time())
        for url, subs in self.subs.items():
            connection = self._connections.get(url)
            if connection is not None and connection.connected and self._live(url, subs):
                self.cursors[url] = now

    def _live(self, url: str, subs: RelaySubscriptions) -> bool:
        """Every REQ on `url` answered in full: the shards' and the watches' (those given up
        on after their EOSE timeout counted and logged here), so the cursor may move on."""
        watches = self._watches.get(url)
        if watches is not None:
            reasons, follow_ups = watches.expire()
            for reason in reasons:
                catchup_metrics.WATCHES_UNANSWERED.labels(series_label(url), reason).inc()
                log.warning("relay %s left a watch REQ unanswered (%s): no longer waited for",
                            series_label(url), reason)
            if follow_ups:
                self._spawn(self._send(url, follow_ups))
            if not watches.live:
                return False
        return subs.live

    # connection callbacks (synchronous, on the reader's task) ---------------------------

    def watches_changed(self) -> None:
        """The watch plan changed: bring every configured relay's watch REQs in line."""
        for url in self._watches:
            self._spawn(self._sync(url))

    def on_open(self, connection: RelayConnection) -> None:
        subs = self.subs.get(connection.url)
        if subs is not None and connection.limits is not None:
            subs.apply_limits(connection.limits)
        watches = self._watches.get(connection.url)
        if watches is not None and connection.limits is not None:
            watches.apply_limits(connection.limits)
        self._spawn(self._sync(connection.url))

    def on_authenticated(self, connection: RelayConnection) -> None:
        subs = self.subs.get(connection.url)
        watches = self._watches.get(connection.url)
        if watches is not None:
            watches.refresh()
        if subs is not None:
            subs.refresh()
            self._spawn(self._sync(connection.url))

    def on_down(self, connection: RelayConnection) -> None:
        reconciling = self._reconcile_tasks.pop(connection.url, None)
        if reconciling is not None:
            # its REQ is gone with the socket: the reconnect's REQ reconciles anew
            reconciling.cancel()
        subs = self.subs.get(connection.url)
        if subs is not None:
            if self._live(connection.url, subs):
                self.cursors[connection.url] = int(time.time())
            subs.connection_lost()
        watches = self._watches.get(connection.url)
        if watches is not None:
            watches.connection_lost()

    def on_gated(self, connection: RelayConnection) -> None:
        if connection.gated_reason:
            self._maybe_gated.discard(connection.url)
        self._port.baselines.relay_gated(connection.url)

    def on_auth_failed(self, connection: RelayConnection) -> None:
        """The bridge's own key always signs; nothing to do."""

    def on_closed(self, connection: RelayConnection, sub_id: str) -> None:
        watches = self._watches.get(connection.url)
        if watches is not None and watches.owns(sub_id):
            follow_ups = watches.closed(sub_id)
            if follow_ups:
                self._spawn(self._send(connection.url, follow_ups))
            return
        subs = self.subs.get(connection.url)
        if subs is not None:
            follow_ups = subs.closed(sub_id)
            if follow_ups:
                self._spawn(self._send(connection.url, follow_ups))

    def on_eose(self, connection: RelayConnection, sub_id: str) -> None:
        url = connection.url
        subs = self.subs.get(url)
        if subs is None:
            return
        watches = self._watches.get(url)
        if watches is not None and watches.owns(sub_id):
            follow_ups = watches.eose(sub_id)
            if follow_ups:
                self._spawn(self._send(url, follow_ups))
            self._watch_counts(url, watches)
        else:
            newly, follow_ups = subs.eose(sub_id)
            if follow_ups:
                self._spawn(self._send(url, follow_ups))
            self._catchup_counts(url, subs)
            if newly:
                self._port.baselines.baselined(url, newly)
        if self._live(url, subs):
            self.cursors[url] = int(time.time())
            self._note_maybe_gated(url, self._maybe_gated_now(url, connection, subs))

    def on_event(
        self, connection: RelayConnection, sub_id: str, raw: Any, received_ms: int
    ) -> None:
        self.deliver(connection.url, sub_id, raw, received_ms)

    def deliver(self, url: str, sub_id: str, raw: Any, received_ms: int) -> None:
        """An EVENT frame (parsed) from the shared connection to `url`: to ingest with its
        subscription context, and the verdict applied here."""
        if url in self._maybe_gated:
            # a DM came through the shared connection after all
            self._note_maybe_gated(url, False)
        feed = self._feeds.get(url)
        if feed is None:
            feed = RelayFeed(url, self.plan.is_configured(url), NO_SUBSCRIPTIONS)
        self._apply(url, self._port.ingest.event(Frame(feed, sub_id, received_ms), raw))

    def deliver_text(self, url: str, text: str, received_ms: int) -> bool:
        """An EVENT frame as text, before any parse; True when ingest took it (see
        RelayConnection's `skip_event`), False for the connection to parse it itself."""
        feed = self._feeds.get(url)
        return feed is not None and self._text(feed, text, received_ms)

    def _text(self, feed: RelayFeed, text: str, received_ms: int) -> bool:
        """A text frame to ingest. While a REQ of the relay is answering with stored events,
        its frames' bytes count as paged catch-up (the connection carries no other large
        frames then)."""
        subs = self.subs.get(feed.url)
        if subs is not None and subs.answering_any:
            head = _SUB_ID.match(text)
            method = subs.answering_method(head.group(1)) if head is not None else None
            if method is not None:
                catchup_metrics.BYTES.labels(series_label(feed.url), method).inc(len(text))
        outcome = self._port.ingest.text(feed, text, received_ms)
        if outcome is Verdict.UNPARSED:
            return False
        url = feed.url
        if url in self._maybe_gated:
            self._note_maybe_gated(url, False)
        self._apply(url, outcome)
        return True

    def _apply(self, url: str, outcome: Stored | Verdict) -> None:
        """Ingest's verdict on a frame: a stored DM counts towards its REQ's page."""
        if type(outcome) is Stored:
            subs = self.subs.get(url)
            if subs is not None:
                if subs.watch_pages and outcome.sub_id in subs.watch_pages:
                    self._watches[url].stored(outcome.sub_id, outcome.event_id,
                                              outcome.created_at)
                else:
                    subs.stored(outcome.sub_id, outcome.event_id, outcome.kind,
                                outcome.created_at)

    def congested(self, connection: RelayConnection) -> bool:
        return self._port.flow.congested(connection.url)

    async def drained(self, connection: RelayConnection) -> None:
        await self._port.flow.drained(connection.url)

    # health -----------------------------------------------------------------------------

    def health(self) -> dict[str, dict[str, Any]]:
        """Per relay: the contract's `connected`/`last_event_at` plus the bridge's own detail."""
        report: dict[str, dict[str, Any]] = {}
        for url, connection in self._connections.items():
            subs = self.subs[url]
            report[url] = {
                "connected": connection.connected,
                "last_event_at": connection.last_event_at,
                "state": connection.state.value,
                "live": connection.connected and self._live(url, subs),
                "gated": connection.gated_reason,
                "configured": self.plan.is_configured(url),
                "subscriptions": subs.subscription_count + (
                    watches.subscription_count if (watches := self._watches.get(url)) else 0
                ),
                "keys": len(subs.keys),
                "unsubscribed": len(subs.overflow),
                "maybe_gated": url in self._maybe_gated,
                "mode": "firehose" if subs.firehose else "filtered",
                "invalid_drops": connection.invalid_drops,
                "backoff_until": connection.backoff_until,
            }
        for url, wanted_by in self.plan.skipped.items():
            report[url] = {
                "connected": False,
                "last_event_at": None,
                "state": "skipped",
                "live": False,
                "gated": None,
                "configured": False,
                "subscriptions": 0,
                "keys": wanted_by,
                "unsubscribed": wanted_by,
                "maybe_gated": False,
            }
        return report

    def _note_maybe_gated(self, url: str, flag: bool) -> None:
        """The flag is sticky across reconnects (so per-user connections do not churn); it
        clears when a DM arrives on the shared connection, the relay is gated or dropped."""
        if flag == (url in self._maybe_gated):
            return
        if flag:
            self._maybe_gated.add(url)
        else:
            self._maybe_gated.discard(url)
        self._port.baselines.relay_gated(url)

    def _maybe_gated_now(
        self, url: str, connection: RelayConnection, subs: RelaySubscriptions
    ) -> bool:
        """A user's DM relay that answers every REQ with EOSE and has never sent a DM: not an
        error, but what nostr-rs-relay's `nip42_dms` looks like (it omits DMs for anyone not
        authenticated as a party, without a CLOSED). Only the flag is reported, never whose."""
        return (
            not self.plan.is_configured(url)
            and bool(self.plan.demand.get(url))
            and connection.connected
            and subs.live
            and connection.gated_reason is None
            and connection.last_event_at is None
        )


async def _send_request(connection: RelayConnection, request: Request) -> None:
    """The new REQ first, then the CLOSE of the one it replaces: no gap in coverage."""
    if request.sub_id is not None:
        await connection.send(["REQ", request.sub_id, *request.filters])
    if request.close is not None:
        await connection.send(["CLOSE", request.close])
