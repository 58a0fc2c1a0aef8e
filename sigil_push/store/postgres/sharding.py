"""This worker's key shards, kept in step with its leases: the bridge watches only those keys.

Each heartbeat (every lease_seconds / 3) renews and balances the leases (`ShardLeaser.tick`);
when the set held changed, a second task hands the bridge the new ownership test, so a long
reshard never delays a renewal. The bridge follows what the last successful heartbeat
confirmed, even when it came back late. When heartbeats fail, what is held lapses by itself a
lease period after the last renewal, and the bridge then lets go of those keys too: a worker
cut off from the database stops watching keys that another worker is about to take over.

A heartbeat that moved shards for the others (a join, a give-back, a clean stop) is announced,
and hearing another worker's announcement (`nudge`) brings this worker's next heartbeat
forward: two workers started together split the shards in a few round trips instead of a
heartbeat per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection

import asyncpg
from prometheus_client import Gauge

from sigil_push.shards import ShardSet
from sigil_push.store.postgres.leases import ShardLeaser
from sigil_push.supervisor import supervise
from sigil_push.telemetry.tracebacks import withheld

log = logging.getLogger(__name__)

CANARY_SHARD = 0  # its lease holder is the one worker that runs the canary probes

SHARDS_HELD = Gauge("sigil_push_worker_shards", "Key shards this worker holds", ["worker"])

Reshard = Callable[[ShardSet], Awaitable[None]]
Narrow = Callable[[Collection[int], int], None]
Announce = Callable[[], Awaitable[None]]


class ShardWatch:
    """Drives one worker's `ShardLeaser` and tells `reshard` whenever its shards change."""

    def __init__(
        self,
        leaser: ShardLeaser,
        reshard: Reshard,
        narrow: Narrow | None = None,
        announce: Announce | None = None,
    ) -> None:
        """`narrow` (the device store's) is told the shards before `reshard`, so the keys the
        bridge then reads are this worker's only. `announce` tells the other workers that a
        heartbeat moved shards (their `nudge`)."""
        self._leaser = leaser
        self._reshard = reshard
        self._narrow = narrow
        self._announce = announce
        self._nudged = asyncio.Event()
        self._held: frozenset[int] | None = None  # None: the bridge not yet told anything
        self._target: frozenset[int] = frozenset()  # what the last heartbeat says to watch
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self._gauge = SHARDS_HELD.labels(leaser.worker_id)

    def held(self) -> list[int]:
        return sorted(self._held or ())

    def runs_canary(self) -> bool:
        """Whether this worker probes: it holds shard 0's lease right now (the leaser's own
        view, which lapses with the lease even between heartbeats)."""
        return CANARY_SHARD in self._leaser.held()

    async def start(self) -> None:
        """Take a first share before the bridge subscribes, then keep heartbeating.

        Renewing and applying run as two tasks: applying a change to a million keys takes
        seconds, and a heartbeat that waited for it would let the leases lapse meanwhile, so
        the shards would bounce between workers instead of settling.
        """
        self._target = await self._tick()
        await self._apply_held()
        # supervised: a heartbeat loop ended by an error nobody expected (asyncpg's
        # ProtocolError, say) would otherwise stop renewing without a word
        self._tasks = [
            supervise("shard-leases", self._renew),
            supervise("shard-apply", self._apply_changes),
        ]

    def watching(self) -> None:
        """The bridge has started: its keys are watched, so give shards back in steps from
        now on (see `ShardLeaser.limit_steps`)."""
        self._leaser.limit_steps()

    def nudge(self) -> None:
        """Another worker moved shards (joined, gave some back, stopped): beat now."""
        self._nudged.set()

    async def _tick(self) -> frozenset[int]:
        """One heartbeat; the shards the bridge should watch now.

        After a heartbeat that succeeded, what the database just confirmed, even if the event
        loop then stalled past the local view's lapse: a worker busy loading a million keys
        would otherwise drop every key at its next heartbeat and load them all again, stalling
        again, for ever. Watching a shard a moment longer than its lease is harmless (another
        owner's pushes are deduplicated by the database), and the next heartbeat corrects it.
        After a failed one, the local view, which lapses: a worker cut off from the database
        lets go of its keys.
        """
        try:
            held = frozenset(await self._leaser.tick())
            if self._leaser.moved and self._announce is not None:
                await self._announce()
            return held
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            log.warning("shard lease heartbeat failed: %s", type(exc).__name__)
            return frozenset(self._leaser.held())

    async def _apply_held(self) -> None:
        held = self._target
        # the first call always tells the bridge, even of no shards: until told, it would
        # watch every key
        if held != self._held:
            log.info("holding %d of %d key shards", len(held), self._leaser.shards)
            told, self._held = self._held, held
            self._gauge.set(len(held))
            shards = self._leaser.shards
            try:
                if self._narrow is not None:
                    self._narrow(held, shards)
                await self._reshard(ShardSet(held, shards, held - (told or frozenset())))
            except BaseException:
                # not applied: the next heartbeat must see a change and apply it again
                self._held = told
                raise

    async def _renew(self) -> None:
        while True:
            leaser = self._leaser
            beat = leaser.confirm_seconds if leaser.confirming else leaser.lease_seconds / 3
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(beat):
                    await self._nudged.wait()
            self._nudged.clear()
            self._target = await self._tick()
            if self._target != self._held:
                self._changed.set()

    async def _apply_changes(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                await self._apply_held()
            except Exception as exc:
                log.error(
                    "applying a shard change failed; retrying at the next heartbeat",
                    exc_info=withheld(exc),
                )

    async def halt(self) -> None:
        """Stop heartbeating (the bridge stops next, so it is told nothing more)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def release(self) -> None:
        """Give every shard back at once, so the other workers take them at their next beat."""
        self._held = frozenset()
        self._gauge.set(0)
        await self._leaser.release()
        if self._announce is not None:
            await self._announce()
