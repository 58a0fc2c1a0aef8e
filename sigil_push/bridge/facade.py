"""The relay bridge: relay frame → verified event → matched devices → outbox, exactly once.

`Bridge` only wires its parts and runs their life cycle; each seam is its own module:

- `ingest`: frames in, verified arrivals out (synchronous, on the readers' tasks);
- `pending`: the hand-off from ingest to the committer, and its back-pressure;
- `committer`: arrivals → devices (less those their owners' choices keep asleep) → outbox
  rows and seen ids, one transaction per batch; the users' mute/contact lists and presence
  lapses (`store/preferences.py`);
- `keys`: which keys are watched where (registrations, relay lists, shards);
- `relay_state`: baselines, cursors and gated relays, for the pool and per-user connections.

Their rows are the store's: the bridge's own connection (`store.interface.BridgeConnection`,
from `store.factory.connect_bridge`) carries the outbox writer, the seen rows and the relay
state (`RelayStateStore`), and the committer's `transaction()`; none of these modules holds SQL.

The pool and the per-user connections are handed one `relays.port.BridgePort` naming the parts
that answer them (ingest, relay state, the pending queue's flow control, the catch-up ledger),
so a frame costs no call through this class and every call up from `relays/` reads as the part
it reaches. `relays/` never imports this package: the port's Protocols are defined there.

Every part is built once, with all it needs (`Bridge.create`, then `__init__` in dependency
order): the port's parts come before the pool, what drives the pool (the key registry, the
committer) after it. Where a part driven later must hear of a change made earlier, it listens:
the registry to `RelayLists` (a key's DM relays changed), the pool to the `WatchPlan`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from sigil_push.bridge.catchup_ledger import CatchupLedger
from sigil_push.bridge.committer import CommitListener, Committer
from sigil_push.bridge.ingest import Ingest
from sigil_push.bridge.iris_watches import IrisWatches
from sigil_push.bridge.keys import KeyRegistry
from sigil_push.bridge.metrics import RelayCounters
from sigil_push.bridge.pending import Pending
from sigil_push.bridge.relay_state import RelayState
from sigil_push.config import Config
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog
from sigil_push.relays.connection import BridgeKeySigner
from sigil_push.relays.discovery import RelayLists, normalize_relay_url
from sigil_push.relays.pool import RelayPlan, RelayPool
from sigil_push.relays.port import BridgePort
from sigil_push.relays.user_inbox import UserInboxes
from sigil_push.relays.watch_requests import WatchPlan
from sigil_push.shards import ShardSet
from sigil_push.store.errors import TRANSIENT_ERRORS, transient
from sigil_push.store.factory import connect_bridge
from sigil_push.store.interface import (
    BridgeConnection,
    DeviceStore,
    IrisSubscriptionStore,
    OutboxStore,
)
from sigil_push.store.seen import SeenEvents
from sigil_push.supervisor import Supervisor
from sigil_push.telemetry.memory_gauges import track
from sigil_push.telemetry.redaction import relay_label

if TYPE_CHECKING:
    from sigil_push.canary import Canary
    from sigil_push.relays.delegated_auth import DelegatedAuth

log = logging.getLogger(__name__)

HOUSEKEEPING_SECONDS = 60.0
PRUNE_EVERY_SECONDS = 3600.0
LAPSE_POLL_SECONDS = 1.0
CATCHUP_ITEMS_SLACK_SECONDS = 3600
"""Deliveries are kept this long past the catch-up window (clock skew, a late reconnect)."""


class Bridge:
    """Watches every relay that may carry a registered key's DMs and feeds the outbox.

    A Devices listener (`registration_changed`) and the owner of the relay pool, which it
    hands its `port`; `health()` is what the API shows per relay. With `delegated_auth`, it
    also reads gated inboxes through per-user connections (`UserInboxes`, same port).

    Made by `create`, which opens the bridge's own connection first, so that every part is
    built once with everything it needs, in dependency order; `close` closes it again.
    """

    @classmethod
    async def create(
        cls,
        config: Config,
        devices: DeviceStore,
        outbox: OutboxStore,
        observations: ObservationLog,
        key: SecretKey,
        delegated_auth: DelegatedAuth | None = None,
        supervisor: Supervisor | None = None,
        iris: IrisSubscriptionStore | None = None,
    ) -> Bridge:
        """The bridge on a connection of its own (`store.factory.connect_bridge`), not started."""
        link = await connect_bridge(config)
        try:
            return cls(
                config, link, devices, outbox, observations, key, delegated_auth, supervisor,
                iris,
            )
        except BaseException:
            await link.close()
            raise

    def __init__(
        self,
        config: Config,
        link: BridgeConnection,
        devices: DeviceStore,
        outbox: OutboxStore,
        observations: ObservationLog,
        key: SecretKey,
        delegated_auth: DelegatedAuth | None = None,
        supervisor: Supervisor | None = None,
        iris: IrisSubscriptionStore | None = None,
    ) -> None:
        """`iris`: the Iris subscriptions, whose filters the bridge watches (`IrisWatches`)."""
        self._bridge = config.bridge
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        self._link = link
        self._insecure = config.server.allow_insecure_relays
        self._lists = RelayLists(link.state, self._insecure)
        # dedupe must remember every id a catch-up can return again
        retention = max(self._bridge.seen_retention_seconds, self._bridge.catchup_seconds)
        self._seen = SeenEvents(link.seen, retention, self._bridge.seen_cache_size)
        track("seen_cache", self._seen, len)
        track("seen_relay_names", self._seen, SeenEvents.relay_names)
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
        pending = Pending()
        # the committer's transactions and the baseline reads take turns on the one connection
        turn = asyncio.Lock()
        # set when a relay turns gated or keys change: the per-user connections, built last (on
        # the pool and the registry), reconcile then
        inboxes_wake = asyncio.Event()
        # the tables the key registry and the Iris watches keep, read by ingest before the
        # pool (which they drive) exists
        keys: set[str] = set()
        plan = RelayPlan(configured, self._bridge.max_relays)
        watch_plan = WatchPlan()
        # ingest's per-relay counters; the committer counts its own drops in them too
        counters: dict[str, RelayCounters] = {}
        # the port's parts, then the port, then the pool on it
        self._relays = RelayState(link.state, self._lists, pending, inboxes_wake, turn)
        self._ledger = CatchupLedger(self._bridge.catchup_seconds, link, turn)
        self._iris = IrisWatches(iris, watch_plan, self._relays.forget_user_lists)
        self._ingest = Ingest(
            self._bridge, pending, self._seen, self._lists, counters, keys, self._ledger,
            plan.kinds, self._iris,
        )
        self.port = BridgePort(
            ingest=self._ingest, baselines=self._relays, flow=pending, catchup=self._ledger
        )
        """The one way up from `relays/`: what the pool and the per-user connections call."""
        self._pool = RelayPool(
            self._bridge, plan, watch_plan, BridgeKeySigner(key), observations, self.port, modes
        )
        # what drives the pool and reads its state
        self._registry = KeyRegistry(
            self._insecure, self._pool, devices, self._relays, inboxes_wake, self._lists, keys
        )
        self._committer = Committer(
            link, self._seen, self._lists, pending, devices, outbox, observations, self._pool,
            counters, self._registry.registration_relays, self._insecure, turn,
            lambda reason: self.supervisor.impaired("bridge-commit", reason), self._bridge,
        )
        self._committer.add_decided_listener(self._ledger.confirm)
        self._tasks: list[asyncio.Task[None]] = []
        self._inboxes: UserInboxes | None = None
        if delegated_auth is not None:
            self._inboxes = UserInboxes(
                delegated_auth, observations, self._bridge, self.port, self._pool,
                self._registry, inboxes_wake,
            )
            delegated_auth.add_listener(self._inboxes.session_changed)

    @property
    def pool(self) -> RelayPool:
        """The relay pool (tests and benches feed frames through `pool.deliver`)."""
        return self._pool

    async def reshard(self, owns: ShardSet) -> None:
        """The service's coordination hands this worker its key shards (`KeyRegistry.reshard`)."""
        await self._registry.reshard(owns)
        self._iris.holds(self._registry.holds)

    def add_commit_listener(self, listener: CommitListener) -> None:
        """Be told of every event whose wakeups reached the outbox (`Committer.add_listener`)."""
        self._committer.add_listener(listener)

    # life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self._load()
        for name, loop in (
            ("bridge-commit", self._committer.run),
            ("bridge-registrations", self._registry.run),
            ("bridge-housekeeping", self._housekeeping_loop),
            ("bridge-presence-lapses", self._lapse_loop),
            ("bridge-iris-watches", self._iris.run),
        ):
            self._tasks.append(self.supervisor.spawn(name, loop, core=True))
        await self._registry.subscribe_loaded()
        if self._inboxes is not None:
            self._inboxes.start()
        log.info(
            "bridge watching %d keys on %d relays", len(self._registry.keys), len(self._pool.subs)
        )

    async def _load(self) -> None:
        """Everything the bridge remembers, and the keys to watch, before any relay is opened."""
        await self._seen.load()
        await self._lists.load()
        async with self._registry.changing:  # a reshard meanwhile waits for the whole load
            registry = self._registry
            loaded = await self._relays.load(registry.holds, registry.held_pairs)
            self._pool.load(loaded.baselines, loaded.cursors)
            await self._registry.load(loaded.keys)
        self._iris.holds(self._registry.holds)
        await self._iris.load()

    async def stop(self) -> None:
        """Close relays first, then finish what was already received, so nothing is lost."""
        if self._inboxes is not None:
            await self._inboxes.stop()
        await self._pool.stop()
        self._ingest.stop()
        await self._relays.sorting_done()  # baselines still being sorted go with the last commit
        self._committer.stop()
        committer, *others = self._tasks
        for task in others:
            task.cancel()
        for task in others:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await committer
        try:
            await self._ledger.flush()
            await self._ledger.save_snapshots(final=True)
            await self.save_cursors()
        except TRANSIENT_ERRORS as exc:
            # the database still refuses writes (the committer gave up too): the next start
            # reads the cursors saved before, so its catch-up reaches further back, not less
            log.error("stopping with the database unavailable (%s): relay cursors not saved",
                      type(exc).__name__)

    async def close(self) -> None:
        """Close the bridge's connection (after `stop`, or instead of `start`)."""
        await self._link.close()

    async def save_cursors(self) -> None:
        """Store how far each relay was read (housekeeping, stop)."""
        await self._relays.save_cursors(self._pool.cursors_to_save())

    def add_probe(self, probe: Canary) -> None:
        """Watch the canary key on its relays (before `start`). Events addressed to it alone are
        handed to `probe.take` after verification: never pushed, never recorded as seen."""
        self._registry.add_probe(probe)
        self._ingest.add_probe(probe)

    def registration_changed(self, pubkey: str) -> None:
        """Devices listener: re-read the key's devices for its next wakeup, and re-plan its
        subscriptions soon (coalesced)."""
        self._committer.devices_changed(pubkey)
        self._registry.registration_changed(pubkey)
        if self._iris.owns(pubkey):
            # an Iris target forgotten (its endpoint gone) may have taken a subscription
            self.iris_changed(pubkey)

    def iris_changed(self, pubkey: str) -> None:
        """Iris store listener: `pubkey`'s subscriptions changed (on any worker)."""
        self._committer.iris_changed()
        self._iris.changed(pubkey)

    def rules_changed(self, pubkey: str) -> None:
        """Devices rules listener (preferences, presence): re-read the key's devices for its
        next wakeup and whether it is follows-only; its relays are as they were, so nothing is
        re-planned (ranking every key's relays per call cost 0.6 s at 100,000 keys)."""
        self._committer.devices_changed(pubkey)
        self._registry.rules_changed(pubkey)

    # housekeeping -----------------------------------------------------------------------

    async def _housekeeping_loop(self) -> None:
        last_prune = 0.0
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            self._pool.note_live()
            await self.save_cursors()
            self._ingest.forget_full_buckets()
            await self._ledger.flush()
            await self._ledger.save_snapshots()
            if time.monotonic() - last_prune >= PRUNE_EVERY_SECONDS:
                last_prune = time.monotonic()
                removed = await self._seen.prune()
                log.info("forgot %d event ids past retention", removed)
                await self._ledger.prune(CATCHUP_ITEMS_SLACK_SECONDS)

    async def _lapse_loop(self) -> None:
        """Presences that lapsed and quiet windows that ended after holding an event back get
        their one wakeup within about LAPSE_POLL_SECONDS (a read of the deferred wakeups, a
        small table; usually none due)."""
        while True:
            await asyncio.sleep(LAPSE_POLL_SECONDS)
            try:
                await self._committer.claim_deferred()
            except TRANSIENT_ERRORS as exc:
                if not transient(exc):  # a busy or lost database: the committer says so, once
                    log.warning("deferred wakeup claim failed (%s); retried", type(exc).__name__)

    def health(self) -> dict[str, dict[str, Any]]:
        """Per relay: the contract's `connected`/`last_event_at` plus the bridge's own detail,
        including, for gated relays, how many users' delegated AUTH works or fails there."""
        report = self._pool.health()
        users = self._inboxes.health() if self._inboxes is not None else {}
        for url, entry in report.items():
            entry.update(users.get(url, {"users_authenticated": 0, "users_failed": 0}))
        # keyed by label, as in logs and records: a user's relay URL may carry their npub
        return {relay_label(url): entry for url, entry in report.items()}
