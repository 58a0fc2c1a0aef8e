"""Single use of NIP-98 auth events: an auth event id is accepted once, then remembered.

Ids are kept a little longer than the clock-skew window, after which the timestamp check alone
rejects the event, so the table stays small; expired ids are pruned in passing, at most once
a minute, by whichever request comes along.
"""

from __future__ import annotations

import time

import aiosqlite

from sigil_push.nostr.nip98 import MAX_CLOCK_SKEW_SECONDS

RETENTION_SECONDS = 2 * MAX_CLOCK_SKEW_SECONDS + 60
PRUNE_INTERVAL_SECONDS = 60.0


class UsedAuthIds:
    def __init__(self, connection: aiosqlite.Connection) -> None:
        self._db = connection
        self._last_prune = time.monotonic()

    async def claim(self, event_id: str) -> bool:
        """Mark the id used; False when it had already been used."""
        if time.monotonic() - self._last_prune > PRUNE_INTERVAL_SECONDS:
            await self.prune()
        inserted = await self._db.execute_fetchall(
            "INSERT INTO nip98_used (event_id, expires_at) VALUES (?, ?) ON CONFLICT DO NOTHING"
            " RETURNING event_id",
            (event_id, int(time.time()) + RETENTION_SECONDS),
        )
        return bool(inserted)

    async def prune(self) -> int:
        self._last_prune = time.monotonic()
        removed = await self._db.execute_fetchall(
            "DELETE FROM nip98_used WHERE expires_at < ? RETURNING event_id", (int(time.time()),)
        )
        return len(removed)
