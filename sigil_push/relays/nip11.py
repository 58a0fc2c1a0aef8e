"""NIP-11 relay information: the limits a relay publishes, so subscriptions never exceed them.

Fetched once per connection object over HTTP(S) (the websocket URL with its scheme swapped),
through the outbound guard (sigil_push/outbound.py): public addresses only, pinned against DNS
rebinding, no redirects, one overall deadline and a bounded body, all on the event loop (no
thread is ever parked on a slow relay). Any failure simply means "no published limits" and the
defaults apply. Published limits can only lower ours: `max_message_length` bounds what we send,
and what we accept stays capped by the guard's frame ceiling whatever the relay advertises.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from sigil_push.outbound import BlockedDestination, OutboundGuard, PinnedResolver, guarded_http

FETCH_TIMEOUT_SECONDS = 5.0
MAX_DOCUMENT_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class RelayLimits:
    """The subset of NIP-11 `limitation` the bridge obeys; None means unpublished."""

    max_message_length: int | None = None
    max_subscriptions: int | None = None
    max_filters: int | None = None
    max_limit: int | None = None
    auth_required: bool = False


def _positive(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def parse_limits(document: Any) -> RelayLimits:
    """Read `limitation` from a decoded NIP-11 document, ignoring anything malformed."""
    limitation = document.get("limitation") if isinstance(document, dict) else None
    if not isinstance(limitation, dict):
        return RelayLimits()
    return RelayLimits(
        max_message_length=_positive(limitation.get("max_message_length")),
        max_subscriptions=_positive(limitation.get("max_subscriptions")),
        max_filters=_positive(limitation.get("max_filters")),
        max_limit=_positive(limitation.get("max_limit")),
        auth_required=limitation.get("auth_required") is True,
    )


def _http_url(relay_url: str) -> str:
    scheme, rest = relay_url.split("://", 1)
    return ("https://" if scheme == "wss" else "http://") + rest


async def _fetch_document(url: str, guard: OutboundGuard | None) -> bytes | None:
    async with guarded_http(url, guard, "nip11") as address:
        connector = aiohttp.TCPConnector(
            resolver=PinnedResolver(address) if address is not None else None,
            limit=1, force_close=True,
        )
        async with aiohttp.ClientSession(
            connector=connector, trust_env=False,
            timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_SECONDS),
        ) as session, session.get(
            url, headers={"Accept": "application/nostr+json"}, allow_redirects=False,
        ) as response:
            if response.status != 200:
                return None
            body = bytearray()
            async for chunk in response.content.iter_chunked(16 * 1024):
                body += chunk
                if len(body) > MAX_DOCUMENT_BYTES:
                    return None
            return bytes(body)


async def fetch_limits(relay_url: str, guard: OutboundGuard | None = None) -> RelayLimits:
    """The relay's published limits, or none on any failure, within FETCH_TIMEOUT_SECONDS."""
    try:
        async with asyncio.timeout(FETCH_TIMEOUT_SECONDS):
            body = await _fetch_document(_http_url(relay_url), guard)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, BlockedDestination):
        return RelayLimits()
    if body is None:
        return RelayLimits()
    try:
        return parse_limits(json.loads(body))
    except (ValueError, RecursionError):  # RecursionError: deep nesting
        return RelayLimits()
