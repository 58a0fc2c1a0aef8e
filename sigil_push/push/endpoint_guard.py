"""SSRF guard for UnifiedPush endpoints, which are URLs chosen by users.

An endpoint must be `https://` and its host must not be, or resolve to, an address the service
could reach but a push distributor would never use: loopback, private, link-local, multicast,
reserved or unspecified, including IPv6 forms that embed such an IPv4 address (mapped,
compatible, 6to4, Teredo, NAT64). `check_endpoint` runs at registration. At send time the
same rule is enforced where it cannot be raced: `PublicResolver` filters the addresses the
HTTP client is about to connect to, so a name that re-points to 127.0.0.1 after registration
(DNS rebinding) is refused, and redirects are never followed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

MAX_ENDPOINT_LENGTH = 2048

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_LOCAL_SUFFIXES = ("localhost", ".local", ".internal", ".home.arpa", ".localdomain")


class UnsafeEndpoint(ValueError):
    """The endpoint URL is malformed or points somewhere the service must not send to."""


class UnsafeResolution(OSError):
    """A name resolved only to non-public addresses (raised inside the HTTP client's resolver)."""


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address can carry traffic to."""
    embedded: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        embedded.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        embedded.append(address.sixtofour)
    if address.teredo is not None:
        embedded.extend(address.teredo)
    if any(address in network for network in _NAT64) or address in _IPV4_COMPATIBLE:
        embedded.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return embedded


def is_public_address(address: IpAddress) -> bool:
    """True for a globally routable unicast address that embeds no non-public IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id is not None:
            return False
        embedded = _embedded_ipv4(address)
        if embedded:
            return all(is_public_address(inner) for inner in embedded)
    return address.is_global and not address.is_multicast


def _parse_address(text: str) -> IpAddress | None:
    """The address a host string denotes without DNS, including inet_aton shorthands
    (`127.1`, `2130706433`, `0x7f000001`) that HTTP clients connect to as addresses."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if not text or text.strip("0123456789abcdefxABCDEFX.") or not text[0].isdigit():
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except OSError:
        return None


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
    host = parts.hostname
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
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise UnsafeEndpoint("endpoint host does not resolve") from None
    for info in infos:
        if not is_public_address(ipaddress.ip_address(str(info[4][0]))):
            raise UnsafeEndpoint("endpoint host resolves to a non-public address")


class PublicResolver(AbstractResolver):
    """An aiohttp resolver that refuses names resolving to any non-public address.

    All-or-nothing like `check_endpoint`: a name with one private address among public ones is
    as suspicious as one with only private addresses.
    """

    def __init__(self) -> None:
        self._inner = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        for result in results:
            if not is_public_address(ipaddress.ip_address(result["host"])):
                raise UnsafeResolution("endpoint host resolves to a non-public address")
        return results

    async def close(self) -> None:
        await self._inner.close()
