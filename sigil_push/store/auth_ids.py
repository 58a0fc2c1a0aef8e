"""Single use of NIP-98 auth events: an auth event id is accepted once, then remembered.

Ids are kept a little longer than the clock-skew window, after which the timestamp check alone
rejects the event, so the table stays small; expired ids are pruned in passing, at most once
a minute. Claims that arrive while a write is in flight are written together in one
statement: under load the replay check costs one SQLite round trip per batch, not per request.
"""

from __future__ import annotations

import asyncio
import time

from sigil_push.nostr.nip98 import MAX_CLOCK_SKEW_SECONDS
from sigil_push.store.interface import AuthIdRows

RETENTION_SECONDS = 2 * MAX_CLOCK_SKEW_SECONDS + 60
PRUNE_INTERVAL_SECONDS = 60.0
MAX_BATCH = 500


class UsedAuthIds:
    """`AuthIdStore`: the batching here, the rows in the engine's `AuthIdRows`."""

    def __init__(self, rows: AuthIdRows) -> None:
        self._rows = rows
        self._last_prune = time.monotonic()
        self._waiting: dict[str, asyncio.Future[bool]] = {}
        self._writer: asyncio.Task[None] | None = None

    async def claim(self, event_id: str) -> bool:
        """Mark the id used; False when it had already been used."""
        if event_id in self._waiting:
            return False
        claimed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[event_id] = claimed
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_waiting())
        return await claimed

    async def _write_waiting(self) -> None:
        while self._waiting:
            batch = dict(list(self._waiting.items())[:MAX_BATCH])
            for event_id in batch:
                del self._waiting[event_id]
            try:
                if time.monotonic() - self._last_prune > PRUNE_INTERVAL_SECONDS:
                    await self.prune()
                expires_at = int(time.time()) + RETENTION_SECONDS
                new = await self._rows.insert_new(list(batch), expires_at)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure
                for future in batch.values():
                    future.set_exception(exc)
                continue
            for event_id, future in batch.items():
                future.set_result(event_id in new)

    async def prune(self) -> int:
        self._last_prune = time.monotonic()
        return await self._rows.prune(int(time.time()))
