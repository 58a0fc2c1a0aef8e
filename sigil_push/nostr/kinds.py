"""Every event kind the service names, once, by the NIP that defines it.

The rest of the package imports these names instead of spelling out numbers, so a reader can
find every place a kind matters by its name.
"""

from __future__ import annotations

METADATA = 0
"""NIP-01 profile metadata (an Iris push's title names its author from it)."""
TEXT_NOTE = 1
"""NIP-01 short text note (mentions and replies)."""
CONTACTS = 3
"""NIP-02 contact list (follows-only wakeups read it)."""
DIRECT_MESSAGE = 4
"""NIP-04 encrypted direct message."""
REPOST = 6
"""NIP-18 repost of a kind 1."""
REACTION = 7
"""NIP-25 reaction."""
SEAL = 13
"""NIP-59 seal, inside a gift wrap."""
CHAT_MESSAGE = 14
"""NIP-17 chat message (the rumor a seal carries)."""
GENERIC_REPOST = 16
"""NIP-18 generic repost."""
GIFT_WRAP = 1059
"""NIP-59 gift wrap: how NIP-17 DMs travel."""
DOUBLE_RATCHET = 1060
"""Iris's double-ratchet messages (encrypted content, decrypted by the app)."""
ZAP_REQUEST = 9734
"""NIP-57 zap request."""
ZAP_RECEIPT = 9735
"""NIP-57 zap receipt."""
MUTE_LIST = 10000
"""NIP-51 mute list."""
RELAY_LIST = 10002
"""NIP-65 relay list (its read relays are a user's fallback DM relays)."""
DM_RELAYS = 10050
"""NIP-17 DM relay list."""
CLIENT_AUTH = 22242
"""NIP-42 relay authentication."""
NOSTR_CONNECT = 24133
"""NIP-46 remote-signing requests and responses."""
HTTP_AUTH = 27235
"""NIP-98 HTTP authorization."""

DM_KINDS = (DIRECT_MESSAGE, GIFT_WRAP)
"""What wakes a device: a NIP-04 DM or a NIP-17 gift wrap."""
DM_RELAY_LISTS = (DM_RELAYS, RELAY_LIST)
"""A user's DM relays: the NIP-17 list, else the NIP-65 read relays."""
USER_LISTS = (MUTE_LIST, CONTACTS)
"""The user's own lists that decide what wakes them."""
