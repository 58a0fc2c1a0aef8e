"""NIP-11 relay information: the limits a relay publishes, so subscriptions never exceed them.

Fetched once per connection object over plain HTTP(S) (the websocket URL with its scheme
swapped); any failure simply means "no published limits" and the defaults apply.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

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


def _fetch_blocking(relay_url: str) -> RelayLimits:
    request = urllib.request.Request(
        _http_url(relay_url), headers={"Accept": "application/nostr+json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=FETCH_TIMEOUT_SECONDS) as response:
            body = response.read(MAX_DOCUMENT_BYTES + 1)
    except (OSError, urllib.error.URLError, ValueError):
        return RelayLimits()
    if len(body) > MAX_DOCUMENT_BYTES:
        return RelayLimits()
    try:
        return parse_limits(json.loads(body))
    except ValueError:
        return RelayLimits()


async def fetch_limits(relay_url: str) -> RelayLimits:
    return await asyncio.to_thread(_fetch_blocking, relay_url)
