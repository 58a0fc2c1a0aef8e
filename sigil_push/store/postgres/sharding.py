"""This worker's key shards, kept in step with its leases: the bridge watches only those keys.

Each heartbeat (every lease_seconds / 3) renews and balances the leases (`ShardLeaser.tick`)
and, when the set held changed, hands the bridge the new ownership test. When a heartbeat
fails, what is held lapses by itself a lease period after the last renewal, and the bridge
then lets go of those keys too: a worker cut off from the database stops watching keys that
another worker is about to take over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import asyncpg
from prometheus_client import Gauge

from sigil_push.shards import shard_of
from sigil_push.store.postgres.leases import ShardLeaser

log = logging.getLogger(__name__)

SHARDS_HELD = Gauge("sigil_push_worker_shards", "Key shards this worker holds", ["worker"])

Reshard = Callable[[Callable[[str], bool]], Awaitable[None]]


class ShardWatch:
    """Drives one worker's `ShardLeaser` and tells `reshard` whenever its shards change."""

    def __init__(self, leaser: ShardLeaser, reshard: Reshard) -> None:
        self._leaser = leaser
        self._reshard = reshard
        self._held: frozenset[int] = frozenset()
        self._task: asyncio.Task[None] | None = None
        self._gauge = SHARDS_HELD.labels(leaser.worker_id)

    def held(self) -> list[int]:
        return sorted(self._held)

    async def start(self) -> None:
        """Take a first share before the bridge subscribes, then keep heartbeating."""
        await self._beat()
        self._task = asyncio.create_task(self._run(), name="shard-leases")

    async def _beat(self) -> None:
        try:
            await self._leaser.tick()
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            log.warning("shard lease heartbeat failed: %s", type(exc).__name__)
        held = frozenset(self._leaser.held())
        if held != self._held:
            log.info("holding %d of %d key shards", len(held), self._leaser.shards)
            self._held = held
            self._gauge.set(len(held))
            shards = self._leaser.shards
            await self._reshard(lambda pubkey: shard_of(pubkey, shards) in held)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._leaser.lease_seconds / 3)
            try:
                await self._beat()
            except Exception:
                log.exception("applying a shard change failed; retrying at the next heartbeat")

    async def halt(self) -> None:
        """Stop heartbeating (the bridge stops next, so it is told nothing more)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def release(self) -> None:
        """Give every shard back at once, so the other workers take them at their next beat."""
        self._held = frozenset()
        self._gauge.set(0)
        await self._leaser.stop()
