"""How a relay URL appears in metric labels, logs and observation records.

Some relays serve one path per user (`wss://filter.nostr.wine/npub1…`, inbox services keyed
by hex pubkey): such a URL names the user it serves, and a user's npub must never reach logs,
labels or records. A path segment that could carry a key (an `npub1`/`nprofile1` bech32 string,
or 64 hex characters) is replaced by `<key-XXXXXXXX>`, a keyed digest under a per-process secret:
stable while the process runs (one connection, one series), linkable to nobody outside it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
from urllib.parse import urlsplit, urlunsplit

_SECRET = os.urandom(32)
_KEYISH = re.compile(
    r"(?:npub1|nprofile1)[02-9ac-hj-np-z]{6,}|[0-9a-fA-F]{64}", re.IGNORECASE
)


def _redact(match: re.Match[str]) -> str:
    digest = hmac.new(_SECRET, match.group(0).lower().encode(), hashlib.sha256).hexdigest()
    return f"<key-{digest[:8]}>"


@functools.lru_cache(maxsize=1024)
def relay_label(url: str) -> str:
    """`url` with any key-carrying path or query text replaced (see the module docstring)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _KEYISH.sub(_redact, url)
    if not _KEYISH.search(parts.path) and not _KEYISH.search(parts.query):
        return url
    return urlunsplit(parts._replace(
        path=_KEYISH.sub(_redact, parts.path), query=_KEYISH.sub(_redact, parts.query)
    ))
