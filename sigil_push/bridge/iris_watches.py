"""Iris subscriptions as watches (issue 33): what the bridge matches events against and asks
relays for on behalf of Iris's stored subscriptions.

Each stored subscription (`IrisSubscriptionStore`, its document as received) is compiled into
watches of class `iris` (`watches.subscription_watches`: one per filter, `#p`- or
`authors`-indexed, for all the subscription's targets), held in one `WatchIndex`. Ingest asks
it, before any signature check, whether a frame's `p` tags or author could wake anyone
(`maybe`), and after the check which watches the event really matches (`matching`); the
committer turns those into the targets' devices.

A subscription created, replaced or deleted through any worker's API reaches every worker's
bridge as a call to `changed(owner)` (the Iris store's listeners: in-process on SQLite,
NOTIFY on PostgreSQL); the owner's subscriptions are read again and their watches replace the
old ones (`WatchIndex.replace_owner`: the cost of that owner's watches, not of everyone's).
An owner left without subscriptions has its mute and contact lists forgotten (`forget`: the
store deletes them only if the key has no device row left, a registration's pair included).
Every change re-publishes what the relays are asked for (`relays.watch_requests.WatchPlan`):
for each indexed key this worker holds (its shards), the kinds its watches want.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from sigil_push.bridge.metrics import IRIS_WATCHES
from sigil_push.bridge.watches import Watch, WatchIndex, subscription_watches
from sigil_push.nostr.event import Event
from sigil_push.nostr.kinds import USER_LISTS
from sigil_push.relays.watch_requests import WatchPlan
from sigil_push.store.errors import TRANSIENT_ERRORS
from sigil_push.store.interface import IrisSubscriptionStore, StoredSubscription

log = logging.getLogger(__name__)

USER_LISTS_SET = frozenset(USER_LISTS)
RETRY_SECONDS = 1.0
"""A subscription change the store could not be asked about is read again after this."""


def _compiled(stored: StoredSubscription) -> list[Watch]:
    try:
        document: Any = json.loads(stored.document)
    except ValueError:
        return []
    if not isinstance(document, dict):
        return []
    return subscription_watches(stored.pubkey, stored.device_ids, document)


def _every_key(_key: str) -> bool:
    return True


def _keep(_keys: list[str]) -> None:
    """No store: nothing to forget."""


class IrisWatches:
    """The Iris subscriptions' watches of this worker (`index`), kept current (`run`), and the
    relay plan they make (`plan`)."""

    def __init__(self, store: IrisSubscriptionStore | None, plan: WatchPlan,
                 forget: Callable[[list[str]], None] = _keep) -> None:
        """`plan` is what relays are asked for (its listeners, the pool, are told of changes);
        `forget` is given this worker's subscribers left without subscriptions."""
        self.index = WatchIndex()
        self._store = store
        self._plan = plan
        self._forget = forget
        self._holds: Callable[[str], bool] = _every_key
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self.active = False
        """Some subscription has a watch (ingest asks nothing of an empty index)."""

    async def load(self) -> None:
        """Every stored subscription, compiled (at start, before any relay is opened)."""
        if self._store is None:
            return
        by_owner: dict[str, list[Watch]] = {}
        for stored in await self._store.all():
            by_owner.setdefault(stored.pubkey, []).extend(_compiled(stored))
        for owner, watches in by_owner.items():
            self.index.replace_owner(owner, watches)
        self.publish()

    def holds(self, holds: Callable[[str], bool]) -> None:
        """Ask relays only for keys `holds` accepts (this worker's key shards)."""
        self._holds = holds
        self.publish()

    def changed(self, owner: str) -> None:
        """`owner`'s subscriptions changed (or may have: a target removed): read them again
        soon (coalesced)."""
        if self._store is None:
            return
        self._dirty.add(owner)
        self._wake.set()

    async def run(self) -> None:
        """Apply subscription changes as they are announced."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            owners, self._dirty = self._dirty, set()
            assert self._store is not None
            try:
                fresh = {owner: await self._store.of_pubkey(owner) for owner in sorted(owners)}
            except TRANSIENT_ERRORS:
                log.warning("reading %d changed Iris subscribers failed; retrying", len(owners))
                self._dirty |= owners
                await asyncio.sleep(RETRY_SECONDS)
                self._wake.set()
                continue
            for owner, stored in fresh.items():
                self.index.replace_owner(owner, [w for s in stored for w in _compiled(s)])
            gone = [owner for owner, stored in fresh.items() if not stored and self._holds(owner)]
            if gone:
                self._forget(gone)
            self.publish()

    def publish(self) -> None:
        """Hand the relays the keys to ask for, each with its watches' kinds."""
        index, holds = self.index, self._holds
        self.active = bool(index)
        IRIS_WATCHES.set(len(index))
        authors = {
            key: index.kinds_for("authors", key) for key in index.author_keys() if holds(key)
        }
        # the subscribers' own mute lists, and contact lists of follows-only ones (the Iris
        # rules read them), like a registered key's
        lists = {owner: index.follows_only(owner) for owner in index.owners() if holds(owner)}
        self._plan.replace(
            {key: index.kinds_for("#p", key) for key in index.p_keys() if holds(key)}, authors,
            lists,
        )

    def owns(self, pubkey: str) -> bool:
        """Whether `pubkey` has a subscription (its mute and contact lists are wanted)."""
        return self.index.has_owner(pubkey)

    def maybe(self, kind: int, tags: Sequence[Sequence[Any]], author: str) -> bool:
        """Before any signature check: could an event of `kind` with these tags, signed by
        `author`, match a watch? (hash lookups; the kinds of the candidates compared)"""
        for watch in self.index.candidates(_p_values(tags), author):
            if not watch.kinds or kind in watch.kinds:
                return True
        return False

    def maybe_raw(self, raw: Any) -> bool:
        """`maybe` on an event as parsed from a frame, nothing validated yet (a firehose's
        unaddressed check): odd shapes are simply not watched."""
        if not isinstance(raw, dict):
            return False
        kind, tags, author = raw.get("kind"), raw.get("tags"), raw.get("pubkey")
        if type(kind) is not int or type(tags) is not list or type(author) is not str:
            return False
        if kind in USER_LISTS_SET and self.owns(author):
            return True  # a subscriber's own mute or contact list
        return self.maybe(kind, [t for t in tags if type(t) is list], author)

    def maybe_text(self, frame: str, p_keys: Sequence[str]) -> bool:
        """On a raw EVENT frame's text (a streaming firehose's drop check), whose `p` tags'
        keys the caller's scan found (`p_keys`): does one of them or the author name a
        watched key? Kinds are left to the parse that follows."""
        index = self.index
        for key in p_keys:
            if key and index.watches_p(key):
                return True
        if index.by_authors:
            # the event object's first `"pubkey":` (an object key: a tag's "pubkey" is followed
            # by a comma); a frame with two is not an event any relay serialises
            author = _AUTHOR.search(frame)
            return author is not None and index.watches_author(author.group(1))
        return False

    def matching(self, event: Event, p_values: Sequence[str] | None = None) -> tuple[Watch, ...]:
        """The watches a verified event matches, whole filters checked (each once); `p_values`:
        its `p` tags' values when the caller has them already (ingest's `Verified.tagged`)."""
        found: dict[int, Watch] = {}
        tagged = _p_values(event.tags) if p_values is None else p_values
        for watch in self.index.candidates(tagged, event.pubkey):
            if id(watch) not in found and watch.matches(
                event.kind, event.pubkey, event.tags, event.id
            ):
                found[id(watch)] = watch
        return tuple(found.values())


_AUTHOR = re.compile(r'"pubkey"\s*:\s*"([0-9a-f]{64})"')


def _p_values(tags: Sequence[Sequence[Any]]) -> list[str]:
    return [tag[1] for tag in tags if len(tag) >= 2 and tag[0] == "p" and type(tag[1]) is str]
