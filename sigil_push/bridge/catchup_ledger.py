"""Which DMs each relay delivered, for negentropy catch-ups (relays/nip77.py): noted on the
readers' tasks, written to the store in bulk (`store.catchup_items`), read back per shard.

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
from typing import Any

from sigil_push.store.errors import STORE_UNAVAILABLE
from sigil_push.store.interface import UNADDRESSED, BridgeConnection

log = logging.getLogger(__name__)

MAX_PENDING_ROWS = 20_000
_EVENT_ID = re.compile(r'"id"\s*:\s*"([0-9a-f]{64})"')
_CREATED_AT = re.compile(r'"created_at"\s*:\s*(\d{1,12})\b')


class CatchupLedger:
    def __init__(self, window_seconds: int) -> None:
        self._window = window_seconds
        self._rows: list[tuple[str, str, str, int]] = []
        self._link: BridgeConnection | None = None
        self._turn: asyncio.Lock | None = None
        self._flushing: asyncio.Task[None] | None = None

    def attach(self, link: BridgeConnection, turn: asyncio.Lock) -> None:
        self._link, self._turn = link, turn

    def note(self, url: str, event_id: str, created_at: int, recipients: tuple[str, ...]) -> None:
        """`url` delivered a verified DM for `recipients` (keys subscribed there)."""
        rows = self._rows
        for recipient in recipients:
            rows.append((url, recipient, event_id, created_at))
        if len(rows) >= MAX_PENDING_ROWS:
            self._flush_soon()

    def note_unaddressed(self, url: str, frame: str) -> None:
        """A firehose relay's DM for nobody here, dropped before any parse: its id and time
        from the raw frame (unverified: it only ever spares fetching it from that relay)."""
        found, when = _EVENT_ID.search(frame), _CREATED_AT.search(frame)
        if found is not None and when is not None:
            self._rows.append((url, UNADDRESSED, found.group(1), int(when.group(1))))
            if len(self._rows) >= MAX_PENDING_ROWS:
                self._flush_soon()

    def note_unaddressed_event(self, url: str, raw: Any) -> None:
        """The same for a parsed frame (a firehose answer before its EOSE)."""
        if not isinstance(raw, dict):
            return
        event_id, created_at = raw.get("id"), raw.get("created_at")
        if type(event_id) is str and len(event_id) == 64 and type(created_at) is int:
            self._rows.append((url, UNADDRESSED, event_id, created_at))
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
        try:
            async with self._turn, link.transaction():
                await link.catchup.add(rows)
        except STORE_UNAVAILABLE as error:
            log.warning("catch-up items not saved: %s", type(error).__name__)
            self._rows = (rows + self._rows)[-MAX_PENDING_ROWS * 5 :]

    async def items(self, url: str, keys: list[str] | None, since: int) -> dict[str, int]:
        """Event id → created_at of the DMs `url` delivered since `since` (for `keys`, or all)."""
        await self.flush()
        if self._link is None or self._turn is None:
            return {}
        async with self._turn:
            return await self._link.catchup.items(url, keys, since)

    async def prune(self, slack_seconds: int) -> int:
        if self._link is None or self._turn is None:
            return 0
        async with self._turn, self._link.transaction():
            return await self._link.catchup.prune(
                int(time.time()) - self._window - slack_seconds
            )
