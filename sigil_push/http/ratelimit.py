"""Which client a request is limited as: its address (behind trusted proxies only) and the
bucket an address falls in. The buckets themselves are `token_bucket.RateLimiter`s, one per IP
and one per npub.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


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
