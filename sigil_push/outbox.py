"""The durable outbox: every (event, device) wakeup is on disk before the first send attempt.

A row leaves the outbox only on a final outcome, so a crash, SIGKILL or provider outage loses
nothing: on start-up whatever is pending is simply due again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

import aiosqlite

from sigil_push.devices import Device
from sigil_push.nostr.event import Event


@dataclass(frozen=True, slots=True)
class Wakeup:
    id: int
    device_id: int
    event_id: str
    relay: str
    event_json: str | None
    first_seen_ms: int
    attempts: int


class Outbox:
    def __init__(self, connection: aiosqlite.Connection) -> None:
        self._db = connection
        self.ready = asyncio.Event()

    async def enqueue(
        self, event: Event, relay: str, first_seen_ms: int, devices: Sequence[Device]
    ) -> int:
        """Queue one wakeup per device; a repeated (device, event) pair is ignored."""
        if not devices:
            return 0
        full_event = json.dumps(event.to_json(), separators=(",", ":"))
        rows = [
            (device.id, event.id, relay, full_event if device.payload == "event" else None,
             first_seen_ms, first_seen_ms)
            for device in devices
        ]
        cursor = await self._db.executemany(
            "INSERT INTO outbox (device_id, event_id, relay, event_json, first_seen_ms,"
            " next_attempt_ms) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            rows,
        )
        added = cursor.rowcount
        await cursor.close()
        self.ready.set()
        return added

    async def due(self, now_ms: int, limit: int) -> list[Wakeup]:
        async with self._db.execute(
            "SELECT id, device_id, event_id, relay, event_json, first_seen_ms, attempts"
            " FROM outbox WHERE next_attempt_ms <= ? ORDER BY next_attempt_ms, id LIMIT ?",
            (now_ms, limit),
        ) as cursor:
            return [Wakeup(*row) for row in await cursor.fetchall()]

    async def next_due_ms(self) -> int | None:
        async with self._db.execute("SELECT MIN(next_attempt_ms) FROM outbox") as cursor:
            row = await cursor.fetchone()
        return int(row[0]) if row and row[0] is not None else None

    async def complete(self, wakeup_ids: Sequence[int]) -> None:
        await self._db.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in wakeup_ids])

    async def reschedule(self, wakeup_ids: Sequence[int], next_attempt_ms: int) -> None:
        await self._db.executemany(
            "UPDATE outbox SET attempts = attempts + 1, next_attempt_ms = ? WHERE id = ?",
            [(next_attempt_ms, i) for i in wakeup_ids],
        )

    async def depth(self) -> int:
        async with self._db.execute("SELECT COUNT(*) FROM outbox") as cursor:
            row = await cursor.fetchone()
        return int(row[0]) if row else 0
