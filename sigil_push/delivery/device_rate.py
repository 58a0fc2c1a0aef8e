"""`DeviceRateLimiter`: the per-device budget (a token bucket) that decides when a device may
get its next push; the planner coalesces what exceeds it.
"""

from __future__ import annotations

from collections.abc import Hashable

from sigil_push.telemetry.memory_gauges import track
from sigil_push.token_bucket import refill


class DeviceRateLimiter:
    """A token bucket per device: `per_minute` pushes a minute, bursting up to the same number
    (or to `burst`).

    Keyed by whatever identifies the physical device to its caller (delivery uses the
    (platform, token) pair, shared by all accounts registered on one phone).

    In memory on purpose: after a restart a device can at worst get one extra burst, and
    nothing about rate limits is worth a disk write per push.
    """

    def __init__(
        self, per_minute: int, burst: int | None = None, structure: str = "device_rate_buckets"
    ) -> None:
        """`burst`: the bucket's size when it is not one minute's allowance (an Iris target's
        budget is a burst of 20, then 10 a minute); `structure`: its name in
        `sigil_push_memory_entries`."""
        self._capacity = float(per_minute if burst is None else burst)
        self._per_ms = per_minute / 60_000.0
        self._buckets: dict[Hashable, tuple[float, int]] = {}
        track(structure, self, lambda d: len(d._buckets))

    def _level(self, device: Hashable, now_ms: int) -> float:
        tokens, at_ms = self._buckets.get(device, (self._capacity, now_ms))
        return refill(tokens, at_ms, now_ms, self._per_ms, self._capacity)

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
