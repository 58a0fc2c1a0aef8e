"""SSRF guard for UnifiedPush endpoints, which are URLs chosen by users.

An endpoint must be `https://` and its host must not be, or resolve to, an address the service
could reach but a push distributor would never use: loopback, private, link-local, multicast,
reserved or unspecified. Checked at registration and again before every send, because DNS can
change in between.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

MAX_ENDPOINT_LENGTH = 2048


class UnsafeEndpoint(ValueError):
    """The endpoint URL is malformed or points somewhere the service must not send to."""


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def parse_endpoint(url: str, allow_private: bool) -> tuple[str, int]:
    """Check the URL's form; returns (host, port). No DNS."""
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
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None and not allow_private and not _is_public(literal):
        raise UnsafeEndpoint("endpoint address is not a public address")
    if literal is None and not allow_private and host.rstrip(".").endswith(("localhost", ".local", ".internal")):
        raise UnsafeEndpoint("endpoint host is not a public name")
    return host, port or (443 if parts.scheme == "https" else 80)


async def check_endpoint(url: str, allow_private: bool) -> None:
    """Raise UnsafeEndpoint unless every address the endpoint's host resolves to is public."""
    host, port = parse_endpoint(url, allow_private)
    if allow_private:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise UnsafeEndpoint("endpoint host does not resolve") from None
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not _is_public(address):
            raise UnsafeEndpoint("endpoint host resolves to a non-public address")
