"""The one guard for every connection the server makes to an address a user chose.

Relays named at registration or in kind 10050/10002 lists, bunker relays of NIP-46 signers,
NIP-11 documents and UnifiedPush endpoints are all attacker-controlled destinations. Without a
guard the server becomes the attacker's proxy into its own network (loopback admin pages, cloud
metadata at 169.254.169.254) and per-relay `/health` a port scanner. The rules, in one place:

- only globally routable unicast addresses, including IPv6 forms that embed a private IPv4
  address (mapped, compatible, 6to4, Teredo, NAT64);
- checked at connect time against the addresses the name resolves to *now*, and the socket is
  opened to exactly the checked address, so a name that re-points after the check (DNS
  rebinding) cannot slip through; TLS SNI and the Host header still carry the original name;
- `ws://`, `http://` and non-public addresses only under the test switches
  (`server.allow_insecure_relays`, `unifiedpush.allow_private_endpoints`); relays the operator
  configured are trusted as they are;
- no redirects (websockets refuses cross-origin redirects once the address is pinned; the
  HTTP fetches pass `allow_redirects=False`);
- one overall deadline for resolve + connect + handshake, not one per read;
- our own size limits: a caller may ask for less, never more than the guard's ceiling;
- at most `per_host` concurrent connections per host name and purpose, so variants of one URL
  (paths, ports) cannot multiply connections to one outside server.

A refused destination raises `BlockedDestination`, an OSError, so callers that already survive
connection failures survive it too; its message never says more than "blocked".
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import aiodns
from aiohttp.abc import AbstractResolver, ResolveResult
from prometheus_client import Counter
from websockets.asyncio.client import ClientConnection, connect

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
LOCAL_SUFFIXES = ("localhost", ".local", ".internal", ".home.arpa", ".localdomain", ".onion")

DNS_TIMEOUT_SECONDS = 3.0
DNS_TRIES = 2
LOOKUPS_PER_REQUESTER = 8
"""Name lookups for user-chosen hosts go through c-ares (aiodns): a lookup is a query on the
event loop, not a thread, and cancelling its caller cancels the query. (With
`socket.getaddrinfo` in a thread pool, a name server that never answered held the threads
after their callers gave up, and every new relay connection and UnifiedPush send queued
behind them.) Each requester (the guard's purposes: relay, user, signer, nip11, canary,
unifiedpush) has its own LOOKUPS_PER_REQUESTER lookups at a time, so one kind of destination
with a slow name server cannot stall the others, and each lookup ends within
DNS_TIMEOUT_SECONDS x DNS_TRIES."""

DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
DEFAULT_PER_HOST = 16
"""Generous enough for hosts that serve one relay path per user (filter.nostr.wine/npub…),
small enough that path and port variants cannot turn one server into `max_relays` sockets."""

BLOCKED = Counter(
    "sigil_push_outbound_blocked_total",
    "Outbound connections refused by the guard, by purpose and reason",
    ["purpose", "reason"],
)


class BlockedDestination(OSError):
    """The destination is not one the server may connect to (or its host is at its cap)."""

    def __init__(self, reason: str) -> None:
        super().__init__("blocked")
        self.reason = reason


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


def parse_address(text: str) -> IpAddress | None:
    """The address a host string denotes without DNS, including inet_aton shorthands
    (`127.1`, `2130706433`, `0x7f000001`) that clients connect to as addresses."""
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


_IDNA_DOTS = str.maketrans({"\u3002": ".", "\uff0e": ".", "\uff61": "."})
"""The full stops IDNA reads as label separators besides the ASCII dot (UTS #46, and Python's
`idna` codec): ideographic U+3002, fullwidth U+FF0E, halfwidth ideographic U+FF61."""


def canonical_host(host: str) -> str:
    """The host as the resolver looks it up: lowercase, and a name with non-ASCII characters
    as its IDNA A-label, which reads the ideographic and fullwidth full stops as dots and
    fullwidth letters and digits as ASCII ones. So `127。0。0。1` and `１２７.０.０.１` are the
    literal address 127.0.0.1 and `ｌｏｃａｌｈｏｓｔ` is localhost, for registration's checks
    (sigil_push/hosts.py) and this guard's alike: what one refuses, the other refuses. A name
    IDNA cannot encode comes back with only its dots mapped (it resolves to nothing)."""
    name = host.lower()
    if name.isascii():
        return name
    name = name.translate(_IDNA_DOTS)
    try:
        return name.encode("idna").decode("ascii").lower()
    except UnicodeError:
        return name


def is_local_name(host: str) -> bool:
    """Names that only mean something inside the server's own network."""
    name = host.rstrip(".").lower()
    return "." not in name or name.endswith(LOCAL_SUFFIXES)


class ResolveFailed(OSError):
    """A user-chosen name did not resolve, whatever the resolver raised for it."""


@dataclass
class _Lookups:
    """The per-requester bounds, for the event loop they were made on, and where to ask."""

    loop: asyncio.AbstractEventLoop | None = None
    requesters: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    nameservers: list[str] | None = None
    """None: the system's (/etc/resolv.conf); tests point it at a server on 127.0.0.1."""


_lookups = _Lookups()


def use_nameservers(servers: list[str] | None) -> None:
    """Resolve through `servers` ("127.0.0.1:5353") from now on; None: the system's."""
    _lookups.nameservers = servers


def _bound_for(requester: str) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if _lookups.loop is not loop:
        _lookups.loop = loop
        _lookups.requesters = {}
    bound = _lookups.requesters.get(requester)
    if bound is None:
        bound = _lookups.requesters[requester] = asyncio.Semaphore(LOOKUPS_PER_REQUESTER)
    return bound


async def getaddrinfo(
    host: str, port: int, family: int = 0, requester: str = "any"
) -> list[Any]:
    """`socket.getaddrinfo`'s answer for a user-chosen name, looked up by c-ares (see
    DNS_TIMEOUT_SECONDS). Every failure is a ResolveFailed (an OSError): the resolver also
    raises its own DNSError and IDNA's UnicodeError, which callers that survive OSError must
    survive too.

    Each lookup has a channel of its own, closed when it ends, is cancelled or fails: no query
    outlives its caller, nor the event loop that would be told its answer (a connection attempt
    costs a lookup anyway; a channel's set-up is small beside it)."""
    async with _bound_for(requester):
        try:
            async with aiodns.DNSResolver(
                nameservers=_lookups.nameservers, timeout=DNS_TIMEOUT_SECONDS, tries=DNS_TRIES
            ) as resolver, asyncio.timeout(DNS_TIMEOUT_SECONDS * DNS_TRIES + 1.0):
                result = await resolver.getaddrinfo(
                    host, family=socket.AddressFamily(family), port=port,
                    type=socket.SOCK_STREAM,
                )
        except TimeoutError:
            raise ResolveFailed("does not resolve: timeout") from None
        except (aiodns.error.DNSError, UnicodeError, ValueError) as exc:
            raise ResolveFailed(f"does not resolve: {type(exc).__name__}") from None
    return [
        (node.family, node.socktype, node.protocol, "", (node.addr[0].decode(), *node.addr[1:]))
        for node in result.nodes
    ]


async def resolve_public(host: str, port: int, requester: str = "any") -> list[str]:
    """Every address `host` resolves to, all of which must be public (all-or-nothing: one
    private address among public ones is as suspicious as only private ones)."""
    literal = parse_address(host)
    if literal is not None:
        if not is_public_address(literal):
            raise BlockedDestination("private address")
        return [str(literal)]
    if is_local_name(host):
        raise BlockedDestination("local name")
    try:
        infos = await getaddrinfo(host, port, requester=requester)
    except OSError:
        raise BlockedDestination("does not resolve") from None
    addresses: list[str] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]))
        if not is_public_address(address):
            raise BlockedDestination("resolves to a private address")
        if str(address) not in addresses:
            addresses.append(str(address))
    if not addresses:
        raise BlockedDestination("does not resolve")
    return addresses


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a URL points: host name (`canonical_host`), port, and whether it is TLS."""

    host: str
    port: int
    secure: bool


def destination(url: str) -> Destination:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise BlockedDestination("malformed URL") from None
    if parts.scheme not in ("ws", "wss", "http", "https") or not parts.hostname:
        raise BlockedDestination("malformed URL")
    secure = parts.scheme in ("wss", "https")
    return Destination(canonical_host(parts.hostname), port or (443 if secure else 80), secure)


@dataclass
class OutboundGuard:
    """Policy plus per-host accounting for outbound connections to user-chosen addresses.

    `allow_private`: the test switch (loopback relays and plain ws://). `trusted`: URLs the
    operator configured, exempt from the address rule and the host cap.
    """

    allow_private: bool = False
    trusted: frozenset[str] = frozenset()
    per_host: int = DEFAULT_PER_HOST
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    uncapped: frozenset[str] = frozenset({"user"})
    """Purposes bounded elsewhere: per-user inbox connections (`bridge.max_user_connections`)
    legitimately share one popular host."""
    _open: dict[tuple[str, str], int] = field(default_factory=dict)

    @classmethod
    def for_urls(cls, allow_private: bool, trusted: Iterable[str], **kwargs: Any) -> OutboundGuard:
        return cls(allow_private, frozenset(u.rstrip("/") for u in trusted), **kwargs)

    def is_trusted(self, url: str) -> bool:
        """A configured relay, also when asked for its NIP-11 document over http(s)."""
        scheme, sep, rest = url.partition("://")
        websocket = {"http": "ws", "https": "wss"}.get(scheme, scheme) + sep + rest
        return websocket.rstrip("/") in self.trusted

    def open_count(self, host: str, purpose: str) -> int:
        return self._open.get((host, purpose), 0)

    async def check(self, url: str, purpose: str) -> tuple[Destination, str | None]:
        """The destination and the one address to connect to (None: let the client resolve,
        for trusted URLs and under the test switch)."""
        try:
            target = destination(url)
            if self.allow_private or self.is_trusted(url):
                return target, None
            if not target.secure:
                raise BlockedDestination("plain-text scheme")
            return target, (await resolve_public(target.host, target.port, purpose))[0]
        except BlockedDestination as exc:
            BLOCKED.labels(purpose, exc.reason).inc()
            raise

    @contextlib.contextmanager
    def slot(self, url: str, host: str, purpose: str) -> Iterator[None]:
        """Hold one of the host's connection slots for `purpose` while the block runs."""
        if self.is_trusted(url) or purpose in self.uncapped:
            yield
            return
        key = (host, purpose)
        if self._open.get(key, 0) >= self.per_host:
            BLOCKED.labels(purpose, "host at its connection cap").inc()
            raise BlockedDestination("host at its connection cap")
        self._open[key] = self._open.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._open[key] - 1
            if left:
                self._open[key] = left
            else:
                del self._open[key]


class _NoRedirectConnect(connect):
    """websockets follows up to 10 redirects; a relay's 3xx must end the attempt instead."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        return exc


class GuardedSocket:
    """`async with open_relay_socket(...) as ws:` — a websockets ClientConnection opened
    through the guard; the host slot is held until the block exits."""

    def __init__(self, url: str, guard: OutboundGuard, purpose: str, open_timeout: float,
                 max_size: int | None, kwargs: dict[str, Any]) -> None:
        self._url = url
        self._guard = guard
        self._purpose = purpose
        self._timeout = open_timeout
        self._max_size = guard.max_frame_bytes if max_size is None else min(max_size, guard.max_frame_bytes)
        self._kwargs = kwargs
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> ClientConnection:
        async with self._stack as stack:
            async with asyncio.timeout(self._timeout):
                target, address = await self._guard.check(self._url, self._purpose)
                stack.enter_context(self._guard.slot(self._url, target.host, self._purpose))
                pinned: dict[str, Any] = {} if address is None else {"host": address, "port": target.port}
                options = {**self._kwargs, "open_timeout": self._timeout, "max_size": self._max_size,
                           "proxy": None, **pinned}
                ws = await _NoRedirectConnect(self._url, **options)
            stack.push_async_callback(ws.close)
            self._stack = stack.pop_all()
            return ws
        raise AssertionError("unreachable")  # pragma: no cover - the block returns or raises

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._stack.aclose()


_default_guard = OutboundGuard()


def configure(guard: OutboundGuard) -> None:
    """Install the process's guard (the service does this at start-up, from the config)."""
    global _default_guard
    _default_guard = guard


def current_guard() -> OutboundGuard:
    return _default_guard


def open_relay_socket(url: str, guard: OutboundGuard | None = None, *, purpose: str = "relay",
                      max_size: int | None = None, open_timeout: float = 10.0,
                      **kwargs: Any) -> GuardedSocket:
    """Open a websocket to a relay through the guard (see the module docstring)."""
    return GuardedSocket(url, guard or _default_guard, purpose, open_timeout, max_size, kwargs)


@contextlib.asynccontextmanager
async def guarded_http(url: str, guard: OutboundGuard | None, purpose: str) -> AsyncIterator[str | None]:
    """Check an HTTP(S) destination and hold its host slot; yields the pinned address."""
    guard = guard or _default_guard
    target, address = await guard.check(url, purpose)
    with guard.slot(url, target.host, purpose):
        yield address


class PinnedResolver(AbstractResolver):
    """An aiohttp resolver that answers with the one address the guard checked, so the HTTP
    client connects exactly there (no second lookup that DNS rebinding could answer)."""

    def __init__(self, address: str) -> None:
        self._address = address

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        family = socket.AF_INET6 if ":" in self._address else socket.AF_INET
        return [ResolveResult(hostname=host, host=self._address, port=port, family=family,
                              proto=0, flags=socket.AI_NUMERICHOST)]

    async def close(self) -> None:
        return None
