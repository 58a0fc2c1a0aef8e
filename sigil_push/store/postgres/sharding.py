"""This worker's key shards, kept in step with its leases: the bridge watches only those keys.

Each heartbeat (every lease_seconds / 3) renews and balances the leases (`ShardLeaser.tick`);
when the set held changed, a second task hands the bridge the new ownership test, so a long
reshard never delays a renewal. The bridge follows what the last successful heartbeat
confirmed, even when it came back late. When heartbeats fail, what is held lapses by itself a
lease period after the last renewal, and the bridge then lets go of those keys too: a worker
cut off from the database stops watching keys that another worker is about to take over. When
the database is back, the next heartbeat hands the bridge its shards again (a change that
failed half way leaves the bridge's state unknown, so the next one applies every held shard).
Meanwhile `problems()` tells `/health` why keys may be unwatched: the store unreachable, no
shard held for longer than a lease, shards nobody holds, a change not applied.

A heartbeat that moved shards for the others (a join, a give-back, a clean stop) is announced,
and hearing another worker's announcement (`nudge`) brings this worker's next heartbeat
forward: two workers started together split the shards in a few round trips instead of a
heartbeat per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection

from prometheus_client import Counter, Gauge

from sigil_push.shards import ShardSet
from sigil_push.store.errors import POSTGRES_FAILURES
from sigil_push.store.postgres.leases import ShardLeaser
from sigil_push.supervisor import supervise
from sigil_push.telemetry.tracebacks import withheld

log = logging.getLogger(__name__)

CANARY_SHARD = 0  # its lease holder is the one worker that runs the canary probes

SHARDS_HELD = Gauge("sigil_push_worker_shards", "Key shards this worker holds", ["worker"])
UNHELD = Gauge(
    "sigil_push_worker_unheld_shards",
    "Key shards held by no live worker (their keys watched by nobody), as this worker's last"
    " successful lease heartbeat saw them",
    ["worker"],
)
HEARTBEAT_FAILURES = Counter(
    "sigil_push_worker_lease_heartbeat_failures_total",
    "Shard lease heartbeats that could not reach the database",
    ["worker"],
)

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
        self._unheld_gauge = UNHELD.labels(leaser.worker_id)
        self._failures = HEARTBEAT_FAILURES.labels(leaser.worker_id)
        self._failing: tuple[float, str] | None = None  # since when, and the last error's type
        self._unheld_since: float | None = None  # some shards held by no live worker
        self._empty_since: float | None = time.monotonic()  # the bridge told of no shards
        self._apply_error: str | None = None  # the bridge's keys lag the leases

    def held(self) -> list[int]:
        return sorted(self._held or ())

    def problems(self) -> dict[str, str]:
        """Why this worker's part of the instance is not watching what it should, by task, for
        `/health` (empty: nothing wrong). Keys go unwatched when the database can't be reached
        (this worker lets go of its shards a lease after its last renewal), when shards are
        held by no live worker for longer than a lease (a hand-over takes less), when this
        worker has held no shard for longer than a lease although there are shards for it, or
        when the bridge could not be brought in line with the leases."""
        now = time.monotonic()
        lease = self._leaser.lease_seconds
        found: dict[str, str] = {}
        if self._failing is not None:
            since, error = self._failing
            found["shard-leases"] = (
                f"the store (PostgreSQL) is unreachable: lease heartbeats failing for"
                f" {now - since:.0f} s ({error})"
            )
        if self._apply_error is not None:
            found["shard-apply"] = (
                f"the bridge's keys lag its leases: applying a shard change failed"
                f" ({self._apply_error}); retried at every heartbeat"
            )
        lonely = self._leaser.live_workers <= self._leaser.shards
        if self._empty_since is not None and now - self._empty_since > lease and lonely:
            found["key-shards"] = f"holding no key shards for {now - self._empty_since:.0f} s"
        elif self._unheld_since is not None and now - self._unheld_since > lease:
            found["key-shards"] = (
                f"{self._leaser.unheld} of {self._leaser.shards} key shards held by no live"
                f" worker for {now - self._unheld_since:.0f} s"
            )
        return found

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

    def reload(self) -> None:
        """Registration changes announced by other workers may have gone unheard (the
        listening connection broke): tell the bridge every held shard again, as gained, so it
        reads their keys afresh (a key already watched is kept)."""
        self._held = None
        self._changed.set()

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
        leaser = self._leaser
        try:
            held = frozenset(await leaser.tick())
        except POSTGRES_FAILURES as exc:
            log.warning("shard lease heartbeat failed: %s", type(exc).__name__)
            self._failures.inc()
            since = self._failing[0] if self._failing is not None else time.monotonic()
            self._failing = (since, type(exc).__name__)
            return frozenset(leaser.held())
        if self._failing is not None:
            log.warning(
                "shard lease heartbeats resumed after %.1f s; holding %d of %d key shards",
                time.monotonic() - self._failing[0], len(held), leaser.shards,
            )
            self._failing = None
        self._unheld_gauge.set(leaser.unheld)
        if not leaser.unheld:
            self._unheld_since = None
        elif self._unheld_since is None:
            self._unheld_since = time.monotonic()
        if leaser.moved and self._announce is not None:
            with contextlib.suppress(*POSTGRES_FAILURES):
                await self._announce()  # a lost nudge costs the others a heartbeat, no more
        return held

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
            except BaseException as exc:
                # Not applied, and maybe half applied: the keys of shards that left may be
                # unwatched already while those arriving are not loaded. What the bridge
                # watches is unknown now, so the next heartbeat applies again from nothing:
                # every shard held counts as gained (a key already watched is kept). Putting
                # back `told` instead made a worker whose reshard failed during a database
                # outage (all keys released, the arriving ones unreadable) believe it watched
                # its shards once the database was back: the same shards came back from the
                # next heartbeat, no change was seen, and their keys stayed unwatched for good.
                self._held = None
                self._apply_error = type(exc).__name__
                raise
            self._apply_error = None
            if held:
                self._empty_since = None
            elif self._empty_since is None:
                self._empty_since = time.monotonic()

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
