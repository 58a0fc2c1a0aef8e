"""Per-client request limits: a token bucket per IP and per npub, kept in memory.

A bucket holds up to one minute's allowance and refills continuously, so short bursts are
fine and sustained abuse is refused with an honest Retry-After. Full buckets are forgotten
periodically, which bounds memory by the number of currently active clients.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Sequence

from sigil_push.telemetry.memory_gauges import track
from sigil_push.token_bucket import refill

PRUNE_EVERY = 10_000

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class RateLimiter:
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


def client_address(peer: str, forwarded_for: str | None, trusted: Sequence[IpNetwork]) -> str:
    """The address a request is rate-limited under.

    Only a peer in `server.trusted_proxies` is believed about `X-Forwarded-For`, and of that
    header only the rightmost address that is not itself a trusted proxy: everything to its
    left was written by the client and can be anything. Without trusted proxies, or from an
    untrusted peer, the peer address itself.
    """
    if not trusted or not forwarded_for or not _is_trusted(peer, trusted):
        return peer
    for hop in reversed(forwarded_for.split(",")):
        candidate = hop.strip()
        try:
            ipaddress.ip_address(candidate)
        except ValueError:
            return peer
        if not _is_trusted(candidate, trusted):
            return candidate
    return peer


IPV6_CLIENT_PREFIX = 64


def rate_limit_key(address: str) -> str:
    """The bucket a client address is limited under: an IPv6 address by its /64 (one home or
    server gets a whole /64 and can pick any of 2^64 addresses), an IPv4 one (also when
    IPv4-mapped) by itself."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, IPV6_CLIENT_PREFIX), strict=False))
    return str(parsed)


def _is_trusted(address: str, trusted: Sequence[IpNetwork]) -> bool:
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(parsed in network for network in trusted)


def trusted_networks(entries: Sequence[str]) -> tuple[IpNetwork, ...]:
    """`server.trusted_proxies` as networks (the config has validated each entry)."""
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in entries)
