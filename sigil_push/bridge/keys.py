"""The key registry: which recipient keys this worker watches (its shards' registered keys and
the canary's), each key's DM relays (registration relays plus its kind 10050/10002 list), the
public kinds its pairs want (`notify`, issue 32: `RelayPlan.kinds`, which the REQs ask for and
ingest matches against before any signature check), and keeping the pool's subscriptions in
line as registrations, relay lists and shards change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from sigil_push.bridge.metrics import KEYS
from sigil_push.bridge.relay_state import RelayState
from sigil_push.bridge.watches import DEFAULT_MASK, DM_KINDS, mask_kinds
from sigil_push.relays.discovery import RelayLists, normalize_relay_url
from sigil_push.relays.pool import NO_RELAYS, RelayPool
from sigil_push.shards import ShardSet
from sigil_push.store.interface import DeviceStore
from sigil_push.store.records import Device
from sigil_push.telemetry.memory_gauges import track

if TYPE_CHECKING:
    from sigil_push.canary import Canary


RESHARD_CHUNK = 10_000
"""Keys a reshard handles between two turns of the event loop (tens of milliseconds)."""


def _follows(devices: Iterable[Device]) -> bool:
    """Some pair of the key takes kind 4 from its follows only: its kind 3 is read."""
    return any(d.rules is not None and d.rules.senders == "follows" for d in devices)


def _mask(devices: Iterable[Device]) -> int:
    """The union of the pairs' `notify` masks: what the key's REQs ask for."""
    mask = 0
    for device in devices:
        mask |= DEFAULT_MASK if device.rules is None else device.rules.notify
    return mask


def _every_key(_pubkey: str) -> bool:
    """One worker (SQLite, or before any shard is leased): the bridge watches every key."""
    return True


class KeyRegistry:
    """`keys` and `registration_relays` are read by ingest and the committer (the same
    objects, changed only here); `run` applies registration and relay list changes.

    A million keys must fit a worker's memory: a key is one string, shared by every structure
    that holds it, and a slot in `keys`; only keys that name relays of their own have entries
    in `registration_relays` and the user relays (absent means none).
    """

    def __init__(
        self,
        insecure: bool,
        pool: RelayPool,
        devices: DeviceStore,
        relays: RelayState,
        inboxes_wake: asyncio.Event,
        lists: RelayLists,
        keys: set[str],
    ) -> None:
        """`inboxes_wake` is set when the watched keys or their relays change (the per-user
        connections reconcile); `lists` are the users' relay lists (a key's DM relays: a newer
        one re-plans its key); `keys` is the set of watched keys this registry keeps (ingest,
        built before the pool this registry drives, reads the same set)."""
        self._insecure = insecure
        self._pool = pool
        self._devices = devices
        self._relays = relays
        self._inboxes_wake = inboxes_wake
        self.keys = keys
        self.registration_relays: dict[str, tuple[str, ...]] = {}
        track("registration_relays", self, lambda k: len(k.registration_relays))
        self._user_relays: dict[str, frozenset[str]] = {}
        self._dirty: set[str] = set()
        self._lists_dirty: set[str] = set()
        self._rules_dirty: set[str] = set()
        self._dirty_event = asyncio.Event()
        self._owns: Callable[[str], bool] = _every_key
        self._probe: Canary | None = None
        self._lists = lists
        lists.add_listener(self.lists_changed)
        self._loaded = False
        """Set by `load`: from then on `reshard` acts (before, `load` reads only what the
        shards then held accept)."""
        self.changing = asyncio.Lock()
        """Held while the keys are loaded or resharded: one change at a time."""

    async def load(self, known: Mapping[str, str]) -> None:
        """Watch the registered keys of our shards (before any relay is opened); a key already
        `known` (baselined) is held as that string, so the two share one. A chunk at a time,
        yielding between chunks: the lease heartbeats run on this loop meanwhile."""
        async for chunk in self._devices.key_chunks():
            for pubkey, relays in chunk.items():
                if self._owns(pubkey):
                    self._add_relays(known.get(pubkey, pubkey), relays)
            await asyncio.sleep(0)
        for pubkey, mask in (await self._devices.notify_masks()).items():
            if pubkey in self.keys:
                self._set_kinds(pubkey, mask)
        self._follow(await self._devices.follows_only())
        self._loaded = True

    def _set_kinds(self, pubkey: str, mask: int) -> bool:
        """The public kinds of the union of the key's pairs' `notify` masks; whether they
        changed."""
        kinds = mask_kinds(mask).difference(DM_KINDS)
        if kinds == self._pool.plan.kinds.get(pubkey, frozenset()):
            return False
        self._pool.plan.set_kinds(pubkey, kinds)
        return True

    def _follow(self, follows: Iterable[str]) -> None:
        """Mark the watched keys among `follows` (keys with a follows-only pair), before their
        REQs are made: only their kind 3 is asked for."""
        for pubkey in follows:
            if pubkey in self.keys:
                self._pool.set_follows(pubkey, True)

    def held_pairs(self) -> list[str] | None:
        """`pubkey[6:8]` of every key `holds` may accept (the canary's included), for reading
        stored rows of ours only; None: no such narrowing (every key, or an odd shard count)."""
        owns = self._owns
        pairs = owns.hex_pairs() if isinstance(owns, ShardSet) else None
        if pairs is not None and self._probe is not None:
            pairs = sorted({*pairs, self._probe.pubkey[6:8]})
        return pairs

    def holds(self, pubkey: str) -> bool:
        """Ours to watch: in our shards, or the canary's."""
        return self._owns(pubkey) or (self._probe is not None and pubkey == self._probe.pubkey)

    def add_probe(self, probe: Canary) -> None:
        self._probe = probe
        self.keys.add(probe.pubkey)
        self._pool.plan.set_key(probe.pubkey, probe.relays)

    def registration_changed(self, pubkey: str) -> None:
        """Re-plan this key's subscriptions soon (coalesced)."""
        self._dirty.add(pubkey)
        self._dirty_event.set()

    def rules_changed(self, pubkey: str) -> None:
        """A pair of this key changed what wakes it (preferences, presence), not its relays:
        only what its REQs ask for is read again (coalesced): whether it is follows-only (its
        kind 3) and its public kinds (`notify`). No relay is re-planned."""
        self._rules_dirty.add(pubkey)
        self._dirty_event.set()

    def lists_changed(self, pubkey: str) -> None:
        """A newer relay list of this key changed its DM relays (`RelayLists` listener):
        re-plan it soon (coalesced)."""
        self._lists_dirty.add(pubkey)
        self._dirty_event.set()

    def user_relays(self, pubkey: str) -> frozenset[str]:
        """The user's own DM relays (registration, kind 10050/10002), configured ones included
        only when the user lists them too: the only relays where the bridge may AUTH as them."""
        return self._user_relays.get(pubkey, NO_RELAYS)

    def _set_key(self, pubkey: str, registration_relays: tuple[str, ...]) -> None:
        own = {
            u for u in (normalize_relay_url(r, self._insecure) for r in registration_relays) if u
        }
        listed = self._lists.relays_of(pubkey)
        inbox = listed or tuple(sorted(own))
        own.update(listed)
        self.keys.add(pubkey)
        # most keys name no relay: they get no entry in these two (a frozenset and two dict
        # slots each were 280 of a key's 900 bytes)
        if own:
            self._user_relays[pubkey] = frozenset(own)
        else:
            self._user_relays.pop(pubkey, None)
        if registration_relays:
            self.registration_relays[pubkey] = registration_relays
        else:
            self.registration_relays.pop(pubkey, None)
        self._pool.plan.set_key(pubkey, own, inbox)

    async def run(self) -> None:
        """Apply registration changes (re-reading the key's devices) and relay list changes
        (which need no database: a start-up with many keys brings many lists at once)."""
        while True:
            await self._dirty_event.wait()
            self._dirty_event.clear()
            pubkeys, self._dirty = self._dirty, set()
            new_lists, self._lists_dirty = self._lists_dirty - pubkeys, set()
            rules, self._rules_dirty = self._rules_dirty - pubkeys, set()
            asking: set[str] = set()
            for pubkey in rules:
                if pubkey in self.keys:
                    devices = await self._devices.of_pubkey(pubkey)
                    self._pool.set_follows(pubkey, _follows(devices))
                    if self._set_kinds(pubkey, _mask(devices)):
                        asking.add(pubkey)
            if asking:
                # only the shards holding these keys, on the relays chosen last time: no
                # relay is ranked, opened or closed
                self._pool.apply(self.keys, asking, replan=False)
            removed: list[str] = []
            elsewhere: set[str] = set()
            for pubkey in pubkeys:
                owned = self._owns(pubkey)
                devices = await self._devices.of_pubkey(pubkey) if owned else []
                if devices:
                    # before the key's first REQ: its whole-list fetch then asks for its kind 3
                    self._pool.set_follows(pubkey, _follows(devices))
                    self._set_key(pubkey, tuple(r for d in devices for r in d.relays))
                    self._set_kinds(pubkey, _mask(devices))
                else:
                    self._unwatch(pubkey)
                    if owned:
                        removed.append(pubkey)
                    else:
                        elsewhere.add(pubkey)
            for pubkey in new_lists:
                if pubkey in self.keys:
                    self._set_key(pubkey, self.registration_relays.get(pubkey, ()))
            pubkeys |= new_lists
            if removed:
                self._relays.forget_keys(removed)
            if pubkeys:
                self.apply(pubkeys, elsewhere)

    def _unwatch(self, pubkey: str) -> None:
        self._pool.set_follows(pubkey, False)
        self.keys.discard(pubkey)
        self._pool.plan.set_kinds(pubkey, frozenset())
        self.registration_relays.pop(pubkey, None)
        self._user_relays.pop(pubkey, None)
        self._pool.plan.remove_key(pubkey)

    async def subscribe_loaded(self) -> None:
        """At start, after `load`: open the relays, then subscribe the keys RESHARD_CHUNK at a
        time with a turn of the event loop after each chunk (a million keys took 0.8 s of CPU
        in one piece, seconds on a loaded machine, with the lease heartbeats waiting)."""
        async with self.changing:
            keys = list(self.keys)
            self._pool.apply(self.keys, (), opening=False)
            for start in range(0, len(keys), RESHARD_CHUNK):
                self.apply(set(keys[start : start + RESHARD_CHUNK]), replan=False)
                await asyncio.sleep(0)
            self.apply(set())

    async def reshard(self, owns: ShardSet) -> None:
        """Watch only the registered keys `owns` accepts (this worker's key shards).

        Keys that leave are unsubscribed first, their baselines kept for their new owner; then
        the keys of the shards `owns.gained` arrive, first taking the baselines other workers
        stored for them, so their catch-up from the relays' cursors pushes what arrived
        meanwhile instead of swallowing it as a baseline. Both go RESHARD_CHUNK keys at a time,
        yielding to the event loop after each chunk: a hand-over of half a million keys must
        not stall the lease heartbeats, the API and ingest for seconds. Releasing before
        loading keeps a worker's memory at the larger of its old and new share, not the sum;
        only the arriving keys' baselines are read.
        """
        self._owns = owns
        async with self.changing:
            if not self._loaded:  # not started yet: `load` watches only what `owns` accepts
                return
            await self._release(owns)
            # nothing gained, nothing to read: letting go of every shard (a worker cut off
            # from its database) must not need the database
            if owns.gained:
                masks = await self._devices.notify_masks(owns.gained, owns.count)
                follows = frozenset(await self._devices.follows_only())
                async for chunk in self._devices.key_chunks(owns.gained, owns.count):
                    items = list(chunk.items())
                    del chunk
                    for pubkey, _ in items:
                        mask = masks.get(pubkey)
                        if mask is not None and owns(pubkey):
                            self._set_kinds(pubkey, mask)
                    for start in range(0, len(items), RESHARD_CHUNK):
                        await self._take(owns, items[start : start + RESHARD_CHUNK], follows)
                        await asyncio.sleep(0)
            # once: relays wanted only by keys that left close, those of arriving keys open
            self.apply(set())

    async def _release(self, owns: Callable[[str], bool]) -> None:
        """Unwatch the keys `owns` no longer accepts, RESHARD_CHUNK at a time."""
        probe = self._probe.pubkey if self._probe is not None else None
        keys = list(self.keys)
        for start in range(0, len(keys), RESHARD_CHUNK):
            leaving = {p for p in keys[start : start + RESHARD_CHUNK]
                       if p != probe and not owns(p) and p in self.keys}
            for pubkey in leaving:
                self._unwatch(pubkey)
            if leaving:
                self.apply(leaving, leaving, replan=False)
                await asyncio.sleep(0)

    async def _take(
        self,
        owns: Callable[[str], bool],
        chunk: list[tuple[str, tuple[str, ...]]],
        follows: frozenset[str],
    ) -> None:
        """Watch one chunk of arriving keys, with the baselines stored for them (and which of
        them are follows-only)."""
        arriving = [(p, relays) for p, relays in chunk if owns(p)]
        if not arriving:
            return
        await self._relays.adopt([p for p, _ in arriving], self._pool.baselines_of)
        for pubkey, relays in arriving:
            self._add_relays(pubkey, relays)
        self._follow(p for p, _ in arriving if p in follows)
        self.apply({p for p, _ in arriving}, replan=False)

    def _add_relays(self, pubkey: str, relays: tuple[str, ...]) -> None:
        """Watch `pubkey` with these device relays too (a key with several devices may come in
        several chunks, and a registration change may have watched it already)."""
        if pubkey not in self.keys:
            self._set_key(pubkey, relays)
            return
        before = self.registration_relays.get(pubkey, ())
        merged = tuple(sorted(set(before).union(relays)))
        if merged != before:
            self._set_key(pubkey, merged)

    def apply(
        self, changed: set[str], elsewhere: Collection[str] = (), replan: bool = True
    ) -> None:
        """Bring connections and shards in line with the plan for the `changed` keys; the
        baselines of keys now watched `elsewhere` (another worker) stay in the database.
        Without `replan`, on the relays chosen last time (see `RelayPool.apply`)."""
        left = [(url, key) for url, key in self._pool.apply(self.keys, changed, replan)
                if key not in elsewhere]
        if left:
            self._relays.forget_baselines(left)
        KEYS.set(len(self.keys))
        self._inboxes_wake.set()
