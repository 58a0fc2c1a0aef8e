"""How a relay URL appears in metric labels, logs and observation records.

Some relays serve one path per user (`wss://filter.nostr.wine/npub1…`, inbox services keyed
by hex pubkey): such a URL names the user it serves, and a user's npub must never reach logs,
labels or records. A part that could carry a key (an `npub1`/`nprofile1` bech32 string,
or 64 hex characters) is replaced by `<key-XXXXXXXX>`, a keyed digest under a per-process secret:
stable while the process runs (one connection, one series), linkable to nobody outside it.

Metric labels go one step further (`series_label`): only configured relays are labelled by URL.
Relays that come only from users (registration `relays`, kind 10050/10002 lists) share the one
label USER_RELAYS, so /metrics has a bounded set of series however many URLs users ever name;
per-URL detail stays on the admin /health and in logs and observation records (as `relay_label`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
from collections.abc import Iterable

_SECRET = os.urandom(32)
_KEYISH = re.compile(
    r"(?:npub1|nprofile1)[02-9ac-hj-np-z]{6,}|[0-9a-fA-F]{64}", re.IGNORECASE
)


USER_RELAYS = "user"
"""The metric label every relay that is not configured shares."""

_configured: frozenset[str] = frozenset()
"""The configured relays' URLs (from config, so bounded). Process-wide because metric series
are: the latest pool's set wins, as for memory_gauges.track (one bridge per process)."""


def configure_relays(urls: Iterable[str]) -> None:
    """Configured relays keep their URL label (the pool calls this with its configured relays)."""
    global _configured
    _configured = frozenset(urls)


def series_label(url: str) -> str:
    """The `relay` label of `url`'s metric series: its (redacted) URL if configured, else
    USER_RELAYS."""
    return relay_label(url) if url in _configured else USER_RELAYS


def _redact(match: re.Match[str]) -> str:
    digest = hmac.new(_SECRET, match.group(0).lower().encode(), hashlib.sha256).hexdigest()
    return f"<key-{digest[:8]}>"


def redact_keys(text: str) -> str:
    """`text` with every string that could be a key replaced as in `relay_label`: for a
    relay's free text (an OK message, a refusal) that may quote a pubkey."""
    return _KEYISH.sub(_redact, text)


@functools.lru_cache(maxsize=1024)
def relay_label(url: str) -> str:
    """`url` with any key-carrying text replaced (see the module docstring), wherever it is:
    the path and query, but also the host (an npub is 63 characters, one DNS label: services
    that serve a user at `npub1….example` exist), the user part and the fragment."""
    return _KEYISH.sub(_redact, url)
