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
from sigil_push.outbound import BlockedDestination, resolve_public
from sigil_push.push.endpoint_guard import PublicResolver, UnsafeEndpoint, check_endpoint
from sigil_push.relays.discovery import normalize_relay_url
from sigil_push.validation import parse_register

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
