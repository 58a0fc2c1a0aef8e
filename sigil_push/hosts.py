"""Host names and literal addresses that users name at registration, checked before anything
is stored: relay URLs (registration and kind 10050/10002 lists), UnifiedPush endpoints and
bunker relays.

A host must be one the resolver can look up at all: IDNA-encodable, each label at most 63
bytes and the whole name at most 253 (a name that fails here once made `getaddrinfo` raise
UnicodeError at connect time, outside the guard). Unless the test switch allows them, literal
non-public addresses (loopback, private, link-local, `127.1`-style shorthands, IPv6 forms that
embed a private IPv4 address) and names that only mean something locally are refused too: the
server would never connect to them (sigil_push/outbound.py), so accepting them only hides the
user's mistake. The connect-time guard stays the real defence, as DNS can change.
"""

from __future__ import annotations

import functools

from prometheus_client import Counter
from publicsuffixlist import PublicSuffixList

from sigil_push.outbound import canonical_host, is_local_name, is_public_address, parse_address

_PUBLIC_SUFFIXES = PublicSuffixList()
"""The Public Suffix List as the pinned package ships it (never fetched at run time)."""
MAX_LABEL_BYTES = 63
MAX_NAME_BYTES = 253
REFUSAL_REASONS = ("not_a_name", "private_address", "local_name")

REFUSED = Counter(
    "sigil_push_hosts_refused_total",
    "Hosts refused before anything was stored (registration, relay lists), by reason",
    ["reason"],
)
for _reason in REFUSAL_REASONS:
    REFUSED.labels(_reason)


__all__ = [
    "InvalidHost", "ascii_name", "canonical_host", "check_host", "is_public_suffix",
    "registrable_domain",
]


class InvalidHost(ValueError):
    """The host cannot be looked up, or is not one the server may connect to."""


def ascii_name(host: str) -> str:
    """The name as DNS carries it (IDNA A-labels), or InvalidHost when it has none."""
    name = host.removesuffix(".")
    if not name:
        raise InvalidHost("host is empty")
    try:
        encoded = name.encode("idna")
    except UnicodeError:
        raise InvalidHost("host is not a valid domain name (IDNA)") from None
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidHost(f"host is longer than {MAX_NAME_BYTES} bytes")
    if any(not 0 < len(label) <= MAX_LABEL_BYTES for label in encoded.split(b".")):
        raise InvalidHost(f"a host label is empty or longer than {MAX_LABEL_BYTES} bytes")
    return encoded.decode("ascii")


def check_host(host: str, allow_private: bool) -> None:
    """Raise InvalidHost unless `host` (a URL's hostname, IPv6 without brackets) may be named.
    `allow_private`: the test switch (loopback relays and endpoints). The host is read as the
    connect-time guard reads it (`canonical_host`: `127。0。0。1` is 127.0.0.1)."""
    host = canonical_host(host)
    literal = parse_address(host)
    if literal is not None:
        if not allow_private and not is_public_address(literal):
            REFUSED.labels("private_address").inc()
            raise InvalidHost("host is not a public address")
        return
    try:
        name = ascii_name(host)
    except InvalidHost:
        REFUSED.labels("not_a_name").inc()
        raise
    if not allow_private and is_local_name(name):
        REFUSED.labels("local_name").inc()
        raise InvalidHost("host is not a public name")


@functools.lru_cache(maxsize=4096)
def registrable_domain(host: str) -> str:
    """The registrable domain a host belongs to (`a.b.example.co.uk` -> `example.co.uk`), by
    the Public Suffix List: what one party controls, and so what per-destination caps count
    (wildcard subdomains of one domain are one destination). A literal address, or a name
    with no registrable part, is its own domain. Unicode names count as their A-label, so the
    two spellings of one name are one domain too."""
    name = canonical_host(host).rstrip(".")
    if not name or parse_address(name) is not None:
        return name
    try:
        name = ascii_name(name)
    except InvalidHost:
        return name
    return _PUBLIC_SUFFIXES.privatesuffix(name) or name


def is_public_suffix(name: str) -> bool:
    """Whether `name` (lowercase A-labels) is a suffix under which anyone may register names
    (`com`, `co.uk`, `googleapis.com`), by the Public Suffix List: no one party controls what
    lies under it."""
    return bool(_PUBLIC_SUFFIXES.is_public(name))
