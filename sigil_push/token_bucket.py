"""Token buckets: the refill every budget shares, and `RateLimiter`, a bucket per key.

`refill` is the arithmetic of per-client request limits (`RateLimiter`, for the API's IPs and
npubs and the signer links' users), per-device pushes (`delivery/device_rate`), per-recipient
events (`bridge/ingest`) and a relay socket's invalid events and signature checks
(`relays/budget`). Each keeps its buckets its own way (a tuple in a dict, slots on an object,
milliseconds or seconds); the arithmetic is here so a fix to it is made once. Imports only the
bottom telemetry package: any layer may use it.
"""

from __future__ import annotations

import math
import time

from sigil_push.telemetry.memory_gauges import track


def refill(tokens: float, since: float, now: float, rate: float, capacity: float) -> float:
    """The tokens a bucket holds at `now` that held `tokens` at `since`, gaining `rate` a unit of
    time (whatever unit `since` and `now` count in) and never more than `capacity`."""
    return min(capacity, tokens + (now - since) * rate)


PRUNE_EVERY = 10_000


class RateLimiter:
    """A token bucket per key (a client address, an npub) kept in memory.

    A bucket holds up to one minute's allowance and refills continuously, so short bursts are
    fine and sustained abuse is refused with an honest Retry-After. Full buckets are forgotten
    periodically, which bounds memory by the number of currently active clients.
    """

    def __init__(self, per_minute: int, structure: str = "") -> None:
        """`structure`: the name its bucket count is reported under (sigil_push_memory_entries)."""
        self._capacity = float(per_minute)
        self._rate = per_minute / 60.0
        self._buckets: dict[str, tuple[float, float]] = {}
        self._checks = 0
        if structure:
            track(structure, self, lambda r: len(r._buckets))

    @property
    def enabled(self) -> bool:
        return self._capacity > 0

    def check(self, key: str, now: float | None = None) -> int:
        """Take one token for `key`; returns 0 if allowed, else seconds to wait."""
        if not self.enabled:
            return 0
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(key, (self._capacity, now))
        tokens = refill(tokens, last, now, self._rate, self._capacity)
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
