"""The key registry: which recipient keys this worker watches (its shards' registered keys and
the canary's), each key's DM relays (registration relays plus its kind 10050/10002 list), and
keeping the pool's subscriptions in line as registrations, relay lists and shards change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from sigil_push.bridge.metrics import KEYS
from sigil_push.bridge.relay_state import RelayState
from sigil_push.relays.discovery import RelayLists, normalize_relay_url
from sigil_push.relays.pool import NO_RELAYS, RelayPool
from sigil_push.relays.user_inbox import UserInboxes
from sigil_push.store.interface import Database, DeviceStore

if TYPE_CHECKING:
    from sigil_push.canary import Canary


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
        inboxes: UserInboxes | None,
    ) -> None:
        self._insecure = insecure
        self._pool = pool
        self._devices = devices
        self._relays = relays
        self._inboxes = inboxes
        self.keys: set[str] = set()
        self.registration_relays: dict[str, tuple[str, ...]] = {}
        self._user_relays: dict[str, frozenset[str]] = {}
        self._dirty: set[str] = set()
        self._lists_dirty: set[str] = set()
        self._dirty_event = asyncio.Event()
        self._owns: Callable[[str], bool] = _every_key
        self._probe: Canary | None = None
        self._db: Database | None = None
        self._lists: RelayLists

    def attach(self, db: Database, lists: RelayLists) -> None:
        """The database and relay lists, as the bridge starts (from then on `reshard` acts)."""
        self._db, self._lists = db, lists

    async def load(self, known: Mapping[str, str]) -> None:
        """Watch the registered keys of our shards (before any relay is opened); a key already
        `known` (baselined) is held as that string, so the two share one."""
        for pubkey, relays in (await self._devices.watched_keys()).items():
            if self._owns(pubkey):
                self._set_key(known.get(pubkey, pubkey), relays)

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

    def lists_changed(self, pubkey: str) -> None:
        """Ingest stored a newer relay list of this key: re-plan it soon (coalesced)."""
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
                if pubkey in self.keys:
                    self._set_key(pubkey, self.registration_relays.get(pubkey, ()))
            pubkeys |= new_lists
            if removed:
                self._relays.forget_keys(removed)
            self.apply(pubkeys, elsewhere)

    def _unwatch(self, pubkey: str) -> None:
        self.keys.discard(pubkey)
        self.registration_relays.pop(pubkey, None)
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
        if db is None:  # not started yet: `load` watches only what `owns` accepts
            return
        watched = await self._devices.watched_keys()
        probe = self._probe.pubkey if self._probe is not None else None
        arriving = {p for p in watched if owns(p) and p not in self.keys}
        leaving = {p for p in self.keys if p != probe and not owns(p)}
        if arriving:
            await self._relays.adopt(db, arriving)
        for pubkey in arriving:
            self._set_key(pubkey, watched[pubkey])
        for pubkey in leaving:
            self._unwatch(pubkey)
        self.apply(arriving | leaving, leaving)

    def apply(self, changed: set[str], elsewhere: Collection[str] = ()) -> None:
        """Bring connections and shards in line with the plan for the `changed` keys; the
        baselines of keys now watched `elsewhere` (another worker) stay in the database."""
        left = [(url, key) for url, key in self._pool.apply(self.keys, changed)
                if key not in elsewhere]
        if left:
            self._relays.forget_baselines(left)
        KEYS.set(len(self.keys))
        if self._inboxes is not None:
            self._inboxes.changed()
