"""Redaction of keys in relay URLs and relay text, for metric labels, logs and observation
records.

Some relays serve one path per user (`wss://filter.nostr.wine/npub1…`, inbox services keyed
by hex pubkey): such a URL names the user it serves, and a user's npub must never reach logs,
labels or records. A part that could carry a key (an `npub1`/`nprofile1` bech32 string,
or 64 hex characters) is replaced by `<key-XXXXXXXX>`, a keyed digest under a per-process secret:
stable while the process runs (one connection, one series), linkable to nobody outside it.
A bottom module (it imports nothing of the package), so observation records and the API use it
without reaching into `relays/`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re

_SECRET = os.urandom(32)
_KEYISH = re.compile(
    r"(?:npub1|nprofile1)[02-9ac-hj-np-z]{6,}|[0-9a-fA-F]{64}", re.IGNORECASE
)


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
