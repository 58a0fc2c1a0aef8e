"""Hosts named at registration (relays, UnifiedPush endpoints, bunker relays) are checked
before anything is stored: a name IDNA cannot encode, a label over 63 bytes, a name over 253
bytes, or a literal non-public address is a 400 with the field's contract code (each of these
was once accepted with 201 and then never connected, or made the resolver raise UnicodeError
past the connect-time guard). The guard's own lookups turn every resolver error into the
OSError its callers survive. The test switches still admit loopback hosts."""

from __future__ import annotations

from typing import Any

import pytest

from sigil_push.errors import BadRequest
from sigil_push.hosts import registrable_domain
from sigil_push.http.validation import parse_register
from sigil_push.outbound import BlockedDestination, OutboundGuard, destination, resolve_public
from sigil_push.push.endpoint_guard import PublicResolver, UnsafeEndpoint, check_endpoint
from sigil_push.relays.discovery import normalize_relay_url

SIGNER = "a" * 64
UNENCODABLE = "a" + "ä" * 70 + ".com"
BAD_HOSTS = [
    UNENCODABLE,
    "x" * 64 + ".example.com",
    ".".join(["abcdefghi"] * 26),  # 259 bytes
    "127.0.0.1",
    "127.1",
    "10.0.0.7",
    "169.254.169.254",
    "[::1]",
    "[fe80::1]",
    "[::ffff:192.168.0.1]",
    "localhost",
]


def _register(**fields: Any) -> None:
    body = {"platform": "android", "device_token": "f" * 40, **fields}
    parse_register(body, "b" * 64, allow_insecure_relays=False)


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_bad_relay_hosts_are_invalid_relays(host: str) -> None:
    with pytest.raises(BadRequest) as refused:
        _register(relays=[f"wss://{host}/inbox"])
    assert refused.value.code == "invalid_relays"
    assert normalize_relay_url(f"wss://{host}", allow_insecure=False) is None


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_bad_bunker_relay_hosts_are_invalid_auth_signer(host: str) -> None:
    with pytest.raises(BadRequest) as refused:
        _register(auth_signer=f"bunker://{SIGNER}?relay=wss://{host}")
    assert refused.value.code == "invalid_auth_signer"


async def test_endpoint_check_refuses_every_bad_host() -> None:
    """The registration route maps UnsafeEndpoint to 400 invalid_device_token (api.py); the
    unencodable host once escaped as UnicodeError, a 500."""
    for host in BAD_HOSTS:
        with pytest.raises(UnsafeEndpoint):
            await check_endpoint(f"https://{host}/up/x", allow_private=False)


async def test_good_hosts_and_the_test_switch() -> None:
    _register(relays=["wss://relay.damus.io", "wss://münchen.example/inbox"],
              auth_signer=f"bunker://{SIGNER}?relay=wss://relay.nsec.app")
    parse_register({"platform": "android", "device_token": "f" * 40,
                    "relays": ["ws://127.0.0.1:7000"],
                    "auth_signer": f"bunker://{SIGNER}?relay=ws://127.0.0.1:7001"},
                   "b" * 64, allow_insecure_relays=True)
    await check_endpoint("http://127.0.0.1:8080/up/x", allow_private=True)


async def test_the_guards_lookups_never_raise_unicode_error() -> None:
    with pytest.raises(BlockedDestination):
        await resolve_public(UNENCODABLE, 443)
    with pytest.raises(OSError):
        await PublicResolver().resolve(UNENCODABLE, 443)


DOTTED = ["127\u30020\u30020\u30021", "127\uff0e0\uff0e0\uff0e1", "127\uff610\uff610\uff611",
          "\uff11\uff12\uff17.\uff10.\uff10.\uff11", "10\u30020\u30020\u30027",
          "169\u3002254\u3002169\u3002254", "\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54",
          "relay\u3002local"]
"""Non-public hosts spelled with the full stops IDNA reads as dots (ideographic U+3002,
fullwidth U+FF0E, halfwidth U+FF61) or with fullwidth digits and letters."""


@pytest.mark.parametrize("host", DOTTED)
async def test_registration_refuses_what_the_connect_time_guard_refuses(host: str) -> None:
    """`127。0。0。1` was accepted at registration (IDNA made it the *name* "127.0.0.1", not a
    literal address) and refused only at connect time (no ASCII dot: a "local name"). Both
    now read the host the same way, and both refuse it."""
    guard = OutboundGuard()
    with pytest.raises(BlockedDestination):
        await guard.check(f"wss://{host}/inbox", "relay")
    with pytest.raises(BadRequest) as refused:
        _register(relays=[f"wss://{host}/inbox"])
    assert refused.value.code == "invalid_relays"
    with pytest.raises(BadRequest) as refused:
        _register(auth_signer=f"bunker://{SIGNER}?relay=wss://{host}")
    assert refused.value.code == "invalid_auth_signer"
    assert normalize_relay_url(f"wss://{host}", allow_insecure=False) is None
    with pytest.raises(UnsafeEndpoint):
        await check_endpoint(f"https://{host}/up/x", allow_private=False)


def test_a_public_name_spelled_with_ideographic_dots_is_one_relay() -> None:
    """The spellings of one name are one URL (one connection), as DNS would look it up."""
    assert normalize_relay_url("wss://relay\u3002damus\uff0eio/", allow_insecure=False) == "wss://relay.damus.io"
    assert destination("wss://Relay\uff61Damus\u3002io").host == "relay.damus.io"
    assert registrable_domain("a\u3002example\u3002co\uff0euk") == "example.co.uk"
