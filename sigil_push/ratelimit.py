"""Per-client request limits: a token bucket per IP and per npub, kept in memory.

A bucket holds up to one minute's allowance and refills continuously, so short bursts are
fine and sustained abuse is refused with an honest Retry-After. Full buckets are forgotten
periodically, which bounds memory by the number of currently active clients.
"""

from __future__ import annotations

import math
import time

PRUNE_EVERY = 10_000


class RateLimiter:
    def __init__(self, per_minute: int) -> None:
        self._capacity = float(per_minute)
        self._rate = per_minute / 60.0
        self._buckets: dict[str, tuple[float, float]] = {}
        self._checks = 0

    @property
    def enabled(self) -> bool:
        return self._capacity > 0

    def check(self, key: str, now: float | None = None) -> int:
        """Take one token for `key`; returns 0 if allowed, else seconds to wait."""
        if not self.enabled:
            return 0
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(key, (self._capacity, now))
        tokens = min(self._capacity, tokens + (now - last) * self._rate)
        self._checks += 1
        if self._checks % PRUNE_EVERY == 0:
            self._prune(now)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return max(1, math.ceil((1.0 - tokens) / self._rate))
        self._buckets[key] = (tokens - 1.0, now)
        return 0

    def _prune(self, now: float) -> None:
        full_after = self._capacity / self._rate
        self._buckets = {
            key: (tokens, last)
            for key, (tokens, last) in self._buckets.items()
            if now - last < full_after
        }
