"""Cross-cutting limits that wrap providers instead of living inside each of them.

`ConcurrencyLimited` caps the pushes in flight per provider (a slow provider must not hold
every socket). `DeviceRateLimiter` is the per-device budget (a token bucket) that decides when
a device may get its next push; the delivery loop coalesces what exceeds it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable

from sigil_push.push.base import Outcome, Sender, WakeupMessage
from sigil_push.push.metrics import IN_FLIGHT
from sigil_push.store.records import Device
from sigil_push.telemetry.memory_gauges import track


class ConcurrencyLimited:
    """A Sender that lets at most `limit` (0: the provider's own maximum) sends run at once.

    A send that finds a free slot takes it with one increment: delivery starts no more sender
    tasks than the limit, so that is every send there, and an asyncio.Semaphore's acquire and
    release were a measurable share of a push. Beyond the limit, sends wait in arrival order
    and a finishing send hands its slot straight to the first of them. The in-flight gauge
    reads the same counter when scraped.
    """

    def __init__(self, inner: Sender, limit: int) -> None:
        self.inner = inner
        self.platform = inner.platform
        self.provider = inner.provider
        self.max_concurrency = min(limit, inner.max_concurrency) if limit > 0 else inner.max_concurrency
        self._sending = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        IN_FLIGHT.labels(inner.provider).set_function(lambda: self._sending)

    def fits(self, data: dict[str, str]) -> bool:
        return self.inner.fits(data)

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        if self._sending >= self.max_concurrency or self._waiting:
            await self._turn()
        else:
            self._sending += 1
        try:
            return await self.inner.send(message, device)
        finally:
            self._release()

    async def _turn(self) -> None:
        """Wait until a finishing send hands over its slot (it stays counted in `_sending`)."""
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # handed a slot just as it was cancelled: pass it on
            elif turn in self._waiting:
                self._waiting.remove(turn)
            raise

    def _release(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._sending -= 1

    async def close(self) -> None:
        await self.inner.close()


class DeviceRateLimiter:
    """A token bucket per device: `per_minute` pushes a minute, bursting up to the same number.

    Keyed by whatever identifies the physical device to its caller (delivery uses the
    (platform, token) pair, shared by all accounts registered on one phone).

    In memory on purpose: after a restart a device can at worst get one extra burst, and
    nothing about rate limits is worth a disk write per push.
    """

    def __init__(self, per_minute: int) -> None:
        self._capacity = float(per_minute)
        self._per_ms = per_minute / 60_000.0
        self._buckets: dict[Hashable, tuple[float, int]] = {}
        track("device_rate_buckets", self, lambda d: len(d._buckets))

    def _level(self, device: Hashable, now_ms: int) -> float:
        tokens, at_ms = self._buckets.get(device, (self._capacity, now_ms))
        return min(self._capacity, tokens + (now_ms - at_ms) * self._per_ms)

    def available(self, device: Hashable, now_ms: int) -> int:
        """How many pushes the device may get right now (a large number when unlimited)."""
        if self._capacity <= 0:
            return 1 << 30
        return int(self._level(device, now_ms))

    def next_allowed_ms(self, device: Hashable, now_ms: int) -> int:
        """When the device's next push is allowed (now, if already)."""
        if self._capacity <= 0:
            return now_ms
        missing = 1.0 - self._level(device, now_ms)
        return now_ms if missing <= 0 else now_ms + int(missing / self._per_ms) + 1

    def spend(self, device: Hashable, now_ms: int, pushes: int = 1) -> None:
        if self._capacity <= 0:
            return
        self._buckets[device] = (self._level(device, now_ms) - pushes, now_ms)

    def prune(self, now_ms: int) -> None:
        """Forget devices whose bucket is full again (they are indistinguishable from new).

        Rebuilt rather than deleted from: a dict losing keys as fast as it gains new ones
        keeps the deleted slots until its entries run out, then resizes to a table for three
        times its live keys, a step of memory long after it was at its steady size (issue 22)."""
        level, capacity = self._level, self._capacity
        self._buckets = {
            device: bucket for device, bucket in self._buckets.items()
            if level(device, now_ms) < capacity
        }
