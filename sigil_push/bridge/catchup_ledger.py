"""Which DMs each relay delivered, for negentropy catch-ups (relays/nip77.py): noted on the
readers' tasks, written to the store in bulk (`CatchupItemsStore`), and kept in memory per
relay: loaded from the store once per process (a firehose relay's whole window in one query;
a keyed relay's rows per key, the first time a shard asks for that key: a key that moved here
from another worker brings what that worker saw), then appended to as DMs are noted, so a
reconnect's catch-up reads nothing from the store (reading the window back per shard was a
cost that grew with the window, not the news).
Memory is bounded like the table, by the window (pruned with it), and by MAX_KEPT_ITEMS per
relay, past which that relay is read from the store as before; its size is the
`catchup_items` series of sigil_push_memory_entries.

Noting costs a tuple append per delivery; the rows reach the store with the housekeeping (or
as soon as MAX_PENDING_ROWS wait), never in the committer's transaction: a row lost to a crash
only makes the next reconciliation fetch that event again, which the seen ids then drop. Every
store call takes the bridge connection's `turn`, as the committer's transactions do. Rows
older than the catch-up window (plus the dedupe slack) are pruned, so memory and table stay
bounded by the window.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from operator import itemgetter
from typing import Any

from sigil_push.memory_gauges import track
from sigil_push.store.errors import STORE_UNAVAILABLE
from sigil_push.store.interface import UNADDRESSED, BridgeConnection

log = logging.getLogger(__name__)

MAX_PENDING_ROWS = 20_000
MAX_KEPT_ITEMS = 2_000_000
"""(recipient, event id) pairs kept in memory per relay (about 100 bytes each beyond the id
strings, which the seen cache and nostr-sdk's kept items share)."""
_RECIPIENT = itemgetter(1)
_EVENT_ID = re.compile(r'"id"\s*:\s*"([0-9a-f]{64})"')
_CREATED_AT = re.compile(r'"created_at"\s*:\s*(\d{1,12})\b')


class _Kept:
    """One relay's deliveries in memory: recipient → event id → created_at."""

    def __init__(self) -> None:
        self.by_key: dict[str, dict[str, int]] = {}
        self.size = 0
        self.loaded_keys: set[str] = set()
        self.all_loaded = False

    def unloaded(self, keys: list[str] | None) -> list[str] | None:
        """Which of `keys` still need reading from the store ([] none; None all of them)."""
        if self.all_loaded:
            return []
        if keys is None:
            return None
        return [key for key in keys if key not in self.loaded_keys]

    def add(self, recipient: str, event_id: str, created_at: int) -> None:
        ids = self.by_key.get(recipient)
        if ids is None:
            ids = self.by_key[recipient] = {}
        if event_id not in ids:
            ids[event_id] = created_at
            self.size += 1

    def items(self, keys: list[str] | None, since: int) -> dict[str, int]:
        found: dict[str, int] = {}
        groups = self.by_key.values() if keys is None else (
            self.by_key[key] for key in keys if key in self.by_key
        )
        for ids in groups:
            for event_id, created_at in ids.items():
                if created_at >= since:
                    found[event_id] = created_at
        return found

    def prune(self, cutoff: int) -> None:
        for recipient in list(self.by_key):
            ids = self.by_key[recipient]
            stale = [event_id for event_id, created_at in ids.items() if created_at < cutoff]
            for event_id in stale:
                del ids[event_id]
            self.size -= len(stale)
            if not ids:
                del self.by_key[recipient]


class CatchupLedger:
    def __init__(self, window_seconds: int) -> None:
        self._window = window_seconds
        self._rows: list[tuple[str, str, str, int]] = []
        self._link: BridgeConnection | None = None
        self._turn: asyncio.Lock | None = None
        self._flushing: asyncio.Task[None] | None = None
        self._kept: dict[str, _Kept] = {}
        """Relays held in memory (absent: not reconciled yet in this process)."""
        self._too_large: set[str] = set()
        """Relays past MAX_KEPT_ITEMS: read from the store per reconciliation instead."""
        self.store_reads = 0
        """Catch-up item reads that went to the store (a load, or a relay too large)."""
        track("catchup_items", self, CatchupLedger.kept_items)

    def kept_items(self) -> int:
        return sum(kept.size for kept in self._kept.values())

    def _keep(self, url: str, recipient: str, event_id: str, created_at: int) -> None:
        kept = self._kept.get(url)
        if kept is not None:
            kept.add(recipient, event_id, created_at)
            if kept.size > MAX_KEPT_ITEMS:
                del self._kept[url]
                self._too_large.add(url)

    def attach(self, link: BridgeConnection, turn: asyncio.Lock) -> None:
        self._link, self._turn = link, turn

    def note(self, url: str, event_id: str, created_at: int, recipients: tuple[str, ...]) -> None:
        """`url` delivered a verified DM for `recipients` (keys subscribed there)."""
        rows = self._rows
        for recipient in recipients:
            rows.append((url, recipient, event_id, created_at))
        if url in self._kept:
            for recipient in recipients:
                self._keep(url, recipient, event_id, created_at)
        if len(rows) >= MAX_PENDING_ROWS:
            self._flush_soon()

    def note_unaddressed(self, url: str, frame: str) -> None:
        """A firehose relay's DM for nobody here, dropped before any parse: its id and time
        from the raw frame (unverified: it only ever spares fetching it from that relay)."""
        found, when = _EVENT_ID.search(frame), _CREATED_AT.search(frame)
        if found is not None and when is not None:
            event_id, created_at = found.group(1), int(when.group(1))
            self._rows.append((url, UNADDRESSED, event_id, created_at))
            self._keep(url, UNADDRESSED, event_id, created_at)
            if len(self._rows) >= MAX_PENDING_ROWS:
                self._flush_soon()

    def note_unaddressed_event(self, url: str, raw: Any) -> None:
        """The same for a parsed frame (a firehose answer before its EOSE)."""
        if not isinstance(raw, dict):
            return
        event_id, created_at = raw.get("id"), raw.get("created_at")
        if type(event_id) is str and len(event_id) == 64 and type(created_at) is int:
            self._rows.append((url, UNADDRESSED, event_id, created_at))
            self._keep(url, UNADDRESSED, event_id, created_at)
            if len(self._rows) >= MAX_PENDING_ROWS:
                self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self.flush())

    async def flush(self) -> None:
        """Write the noted rows (a store outage keeps them for the next try, up to a cap).
        A flush started early (MAX_PENDING_ROWS) is waited for first, so the last flush
        before the connection closes leaves nothing in flight."""
        running = self._flushing
        if running is not None and running is not asyncio.current_task():
            await asyncio.wait({running})
        link = self._link
        if link is None or self._turn is None or not self._rows:
            return
        rows, self._rows = self._rows, []
        # by recipient, so the inserts walk each relay's part of the (relay, pubkey, event_id)
        # key in order instead of a random page per row: with every DM from several relays
        # (a row each) the rows in arrival order cost SQLite 11 us each in a 120,000-row
        # table, most of it pages read back and written again; in this order 7 (a stable
        # sort on one string, 0.1 us a row)
        rows.sort(key=_RECIPIENT)
        try:
            async with self._turn, link.transaction():
                await link.catchup.add(rows)
        except STORE_UNAVAILABLE as error:
            log.warning("catch-up items not saved: %s", type(error).__name__)
            self._rows = (rows + self._rows)[-MAX_PENDING_ROWS * 5 :]

    async def items(self, url: str, keys: list[str] | None, since: int) -> dict[str, int]:
        """Event id → created_at of the DMs `url` delivered since `since` (for `keys`, or all):
        from memory, the relay's rows loaded from the store the first time."""
        kept = self._kept.get(url)
        unloaded = [] if kept is None else kept.unloaded(keys)
        if kept is not None and unloaded == []:
            return kept.items(keys, since)
        await self.flush()
        if self._link is None or self._turn is None:
            return {}
        self.store_reads += 1
        if url in self._too_large:
            async with self._turn:
                return await self._link.catchup.items(url, keys, since)
        if kept is None:
            kept = self._kept[url] = _Kept()
            unloaded = keys
        async with self._turn:
            rows = await self._link.catchup.rows(url, unloaded, self._cutoff(0))
        if unloaded is None:
            kept.all_loaded = True
        else:
            kept.loaded_keys.update(unloaded)
        for recipient, event_id, created_at in rows:
            kept.add(recipient, event_id, created_at)
        # noted but not in the store yet (a store outage keeps them back): in memory too
        for relay, recipient, event_id, created_at in self._rows:
            if relay == url:
                kept.add(recipient, event_id, created_at)
        if kept.size > MAX_KEPT_ITEMS:
            del self._kept[url]
            self._too_large.add(url)
        return kept.items(keys, since)

    def _cutoff(self, slack_seconds: int) -> int:
        return int(time.time()) - self._window - slack_seconds

    async def prune(self, slack_seconds: int) -> int:
        cutoff = self._cutoff(slack_seconds)
        for kept in self._kept.values():
            kept.prune(cutoff)
        if self._link is None or self._turn is None:
            return 0
        async with self._turn, self._link.transaction():
            return await self._link.catchup.prune(cutoff)
