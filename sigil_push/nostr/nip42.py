"""NIP-42 relay authentication: the kind 22242 event that answers a relay's AUTH challenge."""

from __future__ import annotations

from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey

AUTH_KIND = 22242


def auth_event(key: SecretKey, relay_url: str, challenge: str) -> Event:
    """Sign the AUTH answer for `challenge` from the relay at `relay_url`."""
    return sign_event(key, AUTH_KIND, "", [["relay", relay_url], ["challenge", challenge]])
