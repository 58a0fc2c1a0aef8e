"""Which events the bridge has handled, and which relays delivered them: exactly once, durably.

An event id in here was either pushed (its wakeups are in the outbox) or deliberately not
pushed (a pre-registration baseline); either way it is never pushed again. The database keeps
every id for the retention window (at least the catch-up window plus the two days NIP-59 lets
a gift wrap's `created_at` lag behind), and memory keeps a bounded cache of recent ids so the
replays of a catch-up are dropped without a database round trip or a signature check.

The cache is generational (`store.generations.GenerationalCache`), not an LRU: it holds at most
`seen_cache_size` ids and always the ~7/8 most recently remembered of them. An LRU's dict, with
one id deleted per id inserted, resized itself to twice the table long after it was full (a
5.7 MB step of RSS in the 30-minute soak, issue 22).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from sigil_push.store.generations import GenerationalCache
from sigil_push.store.interface import SeenRow, SeenRows

LOOKUP_CHUNK = 500
MAX_KEEP_UNTIL = 2**62
RELAY_SEPARATOR = " "
"""Joins the relays of one event in one row (no URL has a space): `seen_events.relay` lists
every relay that delivered it, in the order they were committed, the first one first
(`seen_on_relay.relay`: further relays recorded before they were appended there)."""


class SeenEvents:
    """`SeenStore`: the cache and batching here, the rows in the engine's `SeenRows`."""

    def __init__(self, rows: SeenRows, retention_seconds: int, cache_size: int) -> None:
        self._rows = rows
        self._retention = retention_seconds
        self._cache_size = max(1, cache_size)
        self._relays: GenerationalCache[tuple[str, ...]] = GenerationalCache(self._cache_size)
        self._interned: dict[str, str] = {}
        self._whole = False
        """The cache holds every row of the database (see `load`): `lookup` has nothing to
        bring in."""

    def relay_names(self) -> int:
        """Relay URLs interned for the cache's rows (grows with the relays ever delivering)."""
        return len(self._interned)

    async def load(self) -> None:
        """Warm the cache with the most recent ids, so a restart's catch-up stays cheap.

        When the database held fewer ids than the cache takes and this process is the rows'
        only writer, the cache holds every id there is, and every id written later goes
        through it: `lookup` asks the database nothing until the cache first drops ids (a
        small instance, most self-hosted ones, never asks; a batch's lookup was a few
        microseconds of SQLite's thread per event, issue 23)."""
        rows = await self._rows.recent(self._cache_size)
        self._remember_rows(rows)
        self._whole = self._rows.sole_writer and len({row[0] for row in rows}) < self._cache_size

    def delivered_by(self, event_id: str, relay: str) -> bool:
        """Hot path, memory only: did this relay already deliver this event?"""
        relays = self._relays.get(event_id)
        return relays is not None and relay in relays

    def relays(self, event_id: str) -> tuple[str, ...] | None:
        """Memory only: the relays known to have delivered the event, None when it is not
        known to be handled (`delivered_by` and `known` in one lookup)."""
        return self._relays.get(event_id)

    def known(self, event_id: str) -> bool:
        """Memory only: is the event known to be handled? (False may still be in the database.)"""
        return event_id in self._relays

    async def lookup(self, event_ids: Iterable[str]) -> None:
        """Bring the database's knowledge of these ids into memory before deciding on them."""
        if self._whole:
            return
        missing = [i for i in dict.fromkeys(event_ids) if i not in self._relays]
        for start in range(0, len(missing), LOOKUP_CHUNK):
            chunk = missing[start : start + LOOKUP_CHUNK]
            # padded (with its last id) to one of a few sizes: each size is its own statement
            # text, which PostgreSQL parses and plans anew and asyncpg prepares in an extra
            # round trip, where a size seen before reuses the prepared statement
            size = min(LOOKUP_CHUNK, max(8, 1 << (len(chunk) - 1).bit_length()))
            chunk += [chunk[-1]] * (size - len(chunk))
            self._remember_rows(await self._rows.lookup(list(map(bytes.fromhex, chunk))))

    def first_delivery(
        self, event_id: str, relay: str, pending: dict[str, tuple[str, ...]]
    ) -> tuple[bool, bool]:
        """Note in `pending` (one batch's decisions, not yet on disk) that `relay` delivered
        the event (after `lookup`). Returns (new_event, new_for_relay).
        """
        relays = pending.get(event_id)
        if relays is None:  # not yet in this batch (a further relay's copy always is)
            relays = self._relays.get(event_id)
        if relays is not None and relay in relays:
            return False, False
        pending[event_id] = (*(relays or ()), relay)
        return relays is None, True

    def remember(self, pending: dict[str, tuple[str, ...]]) -> None:
        """Keep in memory the deliveries `first_delivery` noted, once their write succeeded.

        `pending` holds every relay known for the id (it started from the cache): one move to
        the young generation per event, however many relays delivered it. Its relay strings
        are the caller's own URL objects, one per relay, so they need no interning (rows read
        from the database do). The oldest generations are dropped here, once the batch is
        decided (see `_remember`)."""
        put = self._relays.put
        for event_id, relays in pending.items():
            put(event_id, relays)
        if self._relays.trim():
            self._whole = False

    def _remember_rows(self, rows: Iterable[SeenRow]) -> None:
        for packed_id, first, further in rows:
            event_id = packed_id.hex()
            for relay in first.split(RELAY_SEPARATOR):
                self._remember(event_id, relay)
            if further is not None:
                for relay in further.split(RELAY_SEPARATOR):
                    self._remember(event_id, relay)

    def _remember(self, event_id: str, relay: str | None) -> None:
        """A row read back from the database. The cache is not trimmed here but in
        `remember`, after the batch is decided: trimming while a batch's ids are looked up
        evicted some of them before `first_delivery` saw them when the batch was larger than
        the cache, and those were pushed a second time (issue 24)."""
        relays = self._relays.get(event_id) or ()
        if relay is not None and relay not in relays:
            relays = (*relays, self._interned.setdefault(relay, relay))
        self._relays.put(event_id, relays)

    async def save(
        self,
        new_events: Sequence[tuple[str, tuple[str, ...], int, int]],
        further: Sequence[tuple[str, str]],
    ) -> None:
        """Persist new events as (event_id, relays, first_seen_ms, created_at), `relays` being
        every relay that delivered the event in the batch that first handled it, and the
        deliveries by further relays of a later batch as (event_id, relay).

        Every relay that delivered an event is listed in the event's own `seen_events` row:
        the copies sharing the batch of the first delivery with it as it is inserted, the
        further relays of a later batch appended to it in place (one UPDATE per event). Why
        not a row of their own: with every DM arriving from several relays, an insert keyed
        by a random 64-character id dirties a page of `seen_on_relay` and one of its expiry
        index in every commit (measured, the `seen_on_relay` rows were most of SQLite's work
        with four relays per event, half of it system time in WAL writes), while the event's
        row is updated in place and its index entry stays. An event whose row is gone (past
        retention) is past any catch-up too: no row is made for it. `seen_on_relay` keeps
        the further relays recorded before this change, read with the rest."""
        if new_events:
            # the later of arrival and created_at, plus retention, within int64
            keep, most, join = self._retention, MAX_KEEP_UNTIL, RELAY_SEPARATOR.join
            packed = bytes.fromhex
            await self._rows.insert(
                [
                    (packed(i), relays[0] if len(relays) == 1 else join(relays),
                     min(max(ms // 1000, c) + keep, most))
                    for i, relays, ms, c in new_events
                ],
            )
        if further:
            grouped: dict[str, list[str]] = {}
            for event_id, relay in further:
                relays = grouped.setdefault(event_id, [])
                if relay not in relays:
                    relays.append(relay)
            await self._rows.append_relays(
                [
                    (RELAY_SEPARATOR + RELAY_SEPARATOR.join(relays), bytes.fromhex(event_id))
                    for event_id, relays in grouped.items()
                ],
            )

    async def prune(self, now: int | None = None) -> int:
        """Forget ids past retention (they can no longer be returned by a catch-up)."""
        cutoff = int(time.time()) if now is None else now
        return await self._rows.prune(cutoff)

    def __len__(self) -> int:
        return len(self._relays)
