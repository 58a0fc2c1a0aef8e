"""The UnifiedPush provider: its `[unifiedpush]` table with the VAPID identity, the
`unifiedpush` platform whose token is the distributor's endpoint URL, and its factory.

Endpoints are user-chosen hosts, so registration resolves the host before accepting it
(`admit`), the sender resolves it again on every connection, and delivery caps each host's
share of the in-flight window. The sender itself (pywebpush over aiohttp) is
`unifiedpush_sender.py`, imported only when `[unifiedpush]` is configured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from dataclasses import dataclass

from sigil_push.config import ConfigError
from sigil_push.errors import BadRequest
from sigil_push.identity import KeyFileError
from sigil_push.push.base import Sender
from sigil_push.push.endpoint_guard import UnsafeEndpoint, check_endpoint
from sigil_push.push.provider import DeliveryPolicy, Provider, Resolve
from sigil_push.push.vapid import loaded_public_key
from sigil_push.store.records import Device

log = logging.getLogger(__name__)

MAX_CONCURRENCY = 100
"""aiohttp's default connection limit."""


@dataclass(frozen=True)
class UnifiedPushConfig:
    allow_private_endpoints: bool = False
    # RFC 8292 P-256 key (PEM, or the raw base64url private key web-push tools print);
    # generated 0600 on first start when the file does not exist
    vapid_private_key_file: str = "vapid.pem"
    # the JWT `sub` contact; empty: server.public_url when that is an https:// origin
    vapid_subject: str = ""
    # how long a registration waits for the endpoint's host to resolve before refusing it
    endpoint_check_timeout_seconds: float = 3.0


_MAILTO = re.compile(r"mailto:[^@\s]+@(localhost|[\w%-]+(\.[\w%-]+)+)", re.IGNORECASE)
_HTTPS_ORIGIN = re.compile(r"https://(localhost|[\w-]+(\.[\w-]+)+)", re.IGNORECASE)


def is_vapid_subject(value: str) -> bool:
    """A contact autopush and py-vapid accept as the VAPID `sub`: `mailto:name@domain`, or an
    `https://` origin (scheme and host only: py-vapid refuses a port or a path)."""
    return bool(_MAILTO.fullmatch(value) or _HTTPS_ORIGIN.fullmatch(value))


def _validate(table: UnifiedPushConfig, public_url: str) -> UnifiedPushConfig:
    """The table with `vapid_subject` resolved to the contact that is sent.

    Distributors behind autopush refuse a JWT without `sub`, and some push services refuse one
    they cannot reach, so no made-up address is ever filled in: the default is the instance's
    own public URL when that is an https:// origin, and otherwise the key must be set.
    """
    if not table.vapid_private_key_file:
        raise ConfigError("unifiedpush.vapid_private_key_file", "must not be empty")
    if table.endpoint_check_timeout_seconds <= 0:
        raise ConfigError("unifiedpush.endpoint_check_timeout_seconds", "must be positive")
    subject = table.vapid_subject
    if not subject:
        if not is_vapid_subject(public_url):
            raise ConfigError(
                "unifiedpush.vapid_subject",
                "is required unless server.public_url is an https:// origin:"
                " set a contact such as mailto:ops@example.org",
            )
        subject = public_url
    elif not is_vapid_subject(subject):
        raise ConfigError(
            "unifiedpush.vapid_subject",
            "must be mailto:name@domain or an https:// origin such as https://push.example.org",
        )
    return dataclasses.replace(table, vapid_subject=subject)


def _parse_token(token: str) -> str:
    """Syntax only: `admit` checks where the endpoint leads."""
    if not token.startswith(("https://", "http://")):
        raise BadRequest("invalid_device_token", "a UnifiedPush token is the endpoint's https:// URL")
    return token


async def _admit(table: UnifiedPushConfig | None, endpoint: str) -> None:
    """Refuse an endpoint whose host is internal (SSRF); in dry-run (no table) as strictly."""
    table = table or UnifiedPushConfig()
    try:
        await asyncio.wait_for(
            check_endpoint(endpoint, table.allow_private_endpoints), table.endpoint_check_timeout_seconds
        )
    except TimeoutError:
        raise BadRequest("invalid_device_token", "endpoint host did not resolve in time") from None
    except UnsafeEndpoint as exc:
        raise BadRequest("invalid_device_token", str(exc)) from None


def _info(table: UnifiedPushConfig, resolve: Resolve) -> dict[str, str | None]:
    """`vapid_public_key`: apps hand it to their distributor."""
    return {"vapid_public_key": loaded_public_key(resolve(table.vapid_private_key_file))}


def _device_fields(device: Device) -> dict[str, bool]:
    """Whether wakeups are RFC 8291-encrypted (the registration gave WebPush keys), so an app
    can see that it still registers the way older distributors allowed."""
    return {"encrypted": device.webpush_keys is not None}


async def _create(table: UnifiedPushConfig, resolve: Resolve, timeout_seconds: float) -> Sender:
    from sigil_push.push.unifiedpush_sender import UnifiedPushSender
    from sigil_push.push.vapid import VapidSigner, load_or_create_key

    try:
        key = load_or_create_key(resolve(table.vapid_private_key_file))
    except KeyFileError as exc:
        # never a new key in place of a bad file: apps have bound their endpoints to it
        raise ConfigError("unifiedpush.vapid_private_key_file", str(exc)) from None
    vapid = VapidSigner(key, table.vapid_subject)
    log.info("UnifiedPush VAPID public key %s (sub %s)", vapid.public_key, table.vapid_subject)
    return UnifiedPushSender(table.allow_private_endpoints, timeout_seconds, vapid, PROVIDER)


PROVIDER = Provider(
    name="unifiedpush",
    platform="unifiedpush",
    table=UnifiedPushConfig,
    parse_token=_parse_token,
    policy=DeliveryPolicy(max_concurrency=MAX_CONCURRENCY, per_host_caps=True),
    create=_create,
    validate=_validate,
    admit=_admit,
    webpush_keys=True,
    info=_info,
    device_fields=_device_fields,
)
