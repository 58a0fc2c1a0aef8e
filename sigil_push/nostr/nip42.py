"""NIP-42 relay authentication: the kind 22242 event that answers a relay's AUTH challenge."""

from __future__ import annotations

from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.kinds import CLIENT_AUTH


def auth_event(key: SecretKey, relay_url: str, challenge: str) -> Event:
    """Sign the AUTH answer for `challenge` from the relay at `relay_url`."""
    return sign_event(key, CLIENT_AUTH, "", [["relay", relay_url], ["challenge", challenge]])
