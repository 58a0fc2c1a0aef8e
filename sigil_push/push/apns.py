"""The APNs provider: its `[apns]` table, the `ios` platform and its token, and its factory.

The sender itself (aioapns over HTTP/2) is `apns_sender.py`, imported only when `[apns]` is
configured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sigil_push.config import ConfigError, check_http_url
from sigil_push.errors import BadRequest
from sigil_push.push.base import Sender
from sigil_push.push.provider import DeliveryPolicy, Provider, Resolve

TOKEN = re.compile(r"[0-9a-fA-F]{64,200}")

MAX_CONCURRENCY = 10 * 1000
"""aioapns' default pool: 10 HTTP/2 connections of up to 1000 streams each."""


@dataclass(frozen=True)
class ApnsConfig:
    team_id: str
    key_id: str
    key_file: str
    topic: str
    environment: str = "production"
    endpoint: str = ""
    ca_file: str = ""


def _validate(table: ApnsConfig, public_url: str) -> ApnsConfig:
    if table.environment not in ("production", "sandbox"):
        raise ConfigError("apns.environment", "must be 'production' or 'sandbox'")
    if table.endpoint:
        check_http_url("apns.endpoint", table.endpoint)
    return table


def _parse_token(token: str) -> str:
    """64 to 200 hex characters, stored lowercase (APNs tokens are case-insensitive)."""
    if not TOKEN.fullmatch(token):
        raise BadRequest("invalid_device_token", "an APNs token is 64 to 200 hex characters")
    return token.lower()


async def _create(table: ApnsConfig, resolve: Resolve, timeout_seconds: float) -> Sender:
    from sigil_push.push.apns_sender import ApnsSender

    ca_file = resolve(table.ca_file) if table.ca_file else None
    return await ApnsSender.create(
        table, resolve(table.key_file), ca_file, timeout_seconds, PROVIDER
    )


PROVIDER = Provider(
    name="apns",
    platform="ios",
    table=ApnsConfig,
    parse_token=_parse_token,
    policy=DeliveryPolicy(max_concurrency=MAX_CONCURRENCY),
    create=_create,
    validate=_validate,
    file_keys=("key_file", "ca_file"),
)
