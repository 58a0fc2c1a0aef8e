"""SSRF guard for UnifiedPush endpoints, which are URLs chosen by users.

An endpoint must be `https://` and its host must not be, or resolve to, an address the service
could reach but a push distributor would never use: loopback, private, link-local, multicast,
reserved or unspecified, including IPv6 forms that embed such an IPv4 address (mapped,
compatible, 6to4, Teredo, NAT64). `check_endpoint` runs at registration. At send time the
same rule is enforced where it cannot be raced: `PublicResolver` filters the addresses the
HTTP client is about to connect to, so a name that re-points to 127.0.0.1 after registration
(DNS rebinding) is refused, and redirects are never followed.

The address rules themselves live in sigil_push/outbound.py, the one guard for every
user-chosen destination (relays, bunker relays, NIP-11, UnifiedPush).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult

from sigil_push.hosts import InvalidHost, check_host
from sigil_push.outbound import LOCAL_SUFFIXES as _LOCAL_SUFFIXES
from sigil_push.outbound import canonical_host, getaddrinfo, is_public_address, parse_address

MAX_ENDPOINT_LENGTH = 2048

_parse_address = parse_address


class UnsafeEndpoint(ValueError):
    """The endpoint URL is malformed or points somewhere the service must not send to."""


class UnsafeResolution(OSError):
    """A name resolved only to non-public addresses (raised inside the HTTP client's resolver)."""


def parse_endpoint(url: str, allow_private: bool) -> tuple[str, int]:
    """Check the URL's form and any literal address; returns (host, port). No DNS."""
    if len(url) > MAX_ENDPOINT_LENGTH:
        raise UnsafeEndpoint(f"endpoint longer than {MAX_ENDPOINT_LENGTH} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise UnsafeEndpoint("endpoint is not a valid URL") from None
    allowed_schemes = ("https", "http") if allow_private else ("https",)
    if parts.scheme not in allowed_schemes:
        raise UnsafeEndpoint("endpoint must be an https:// URL")
    if not parts.hostname or parts.username or parts.password:
        raise UnsafeEndpoint("endpoint must name a host and carry no credentials")
    host = canonical_host(parts.hostname)
    try:
        check_host(host, allow_private)
    except InvalidHost as exc:
        raise UnsafeEndpoint(f"endpoint {exc}") from None
    if not allow_private:
        literal = _parse_address(host)
        if literal is not None and not is_public_address(literal):
            raise UnsafeEndpoint("endpoint address is not a public address")
        if literal is None and host.rstrip(".").endswith(_LOCAL_SUFFIXES):
            raise UnsafeEndpoint("endpoint host is not a public name")
    return host, port or (443 if parts.scheme == "https" else 80)


async def check_endpoint(url: str, allow_private: bool) -> None:
    """Raise UnsafeEndpoint unless every address the endpoint's host resolves to is public."""
    host, port = parse_endpoint(url, allow_private)
    if allow_private or _parse_address(host) is not None:
        return
    try:
        infos = await getaddrinfo(host, port, requester="unifiedpush-check")
    except OSError:
        raise UnsafeEndpoint("endpoint host does not resolve") from None
    for info in infos:
        if not is_public_address(ipaddress.ip_address(str(info[4][0]))):
            raise UnsafeEndpoint("endpoint host resolves to a non-public address")


class PublicResolver(AbstractResolver):
    """An aiohttp resolver that refuses names resolving to any non-public address.

    All-or-nothing like `check_endpoint`: a name with one private address among public ones is
    as suspicious as one with only private addresses. Lookups go through the outbound guard's
    resolver (c-ares, bounded per requester), so endpoints on slow name servers hold no thread.
    """

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        try:
            infos = await getaddrinfo(host, port, family, requester="unifiedpush")
        except OSError as exc:
            raise OSError(f"endpoint host does not resolve: {type(exc).__name__}") from None
        results: list[ResolveResult] = []
        for family_found, _, proto, _, sockaddr in infos:
            address = str(sockaddr[0])
            if not is_public_address(ipaddress.ip_address(address)):
                raise UnsafeResolution("endpoint host resolves to a non-public address")
            results.append(ResolveResult(
                hostname=host, host=address, port=int(sockaddr[1]), family=family_found,
                proto=proto, flags=socket.AI_NUMERICHOST,
            ))
        return results

    async def close(self) -> None:
        return None
