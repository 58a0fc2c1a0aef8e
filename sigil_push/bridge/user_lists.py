"""The users' own lists (issue 20): NIP-51 kind 10000 mute lists and NIP-02 kind 3 contact
lists, read where the bridge reads their kind 10050/10002 relay lists.

Only the public `p` tags count (a mute list's private items are encrypted to the user). A list
is reduced here, once verified, to what the store keeps: its keys packed 32 bytes each, at most
MAX_LIST_ENTRIES of them, so one user's 100,000-tag list costs the store and every later
lookup no more than anyone's 10,000.
"""

from __future__ import annotations

from sigil_push.bridge.metrics import USER_LISTS_BY
from sigil_push.nostr.event import Event
from sigil_push.nostr.kinds import USER_LISTS
from sigil_push.store.preferences import UserList
from sigil_push.store.records import KEY_BYTES, pack_keys

USER_LIST_KINDS_SET = frozenset(USER_LISTS)
MAX_LIST_ENTRIES = 10_000
_HEX = frozenset("0123456789abcdef")


def user_list_of(event: Event) -> UserList:
    """The stored form of a verified kind 10000 or 3: its first MAX_LIST_ENTRIES distinct
    valid `p` keys; the `p` tags past the cap are counted as truncated, not read."""
    keys: set[str] = set()
    truncated = 0
    tags = event.tags
    for index, tag in enumerate(tags):
        if len(tag) < 2 or tag[0] != "p":
            continue
        key = tag[1]
        if len(key) != 64 or not _HEX.issuperset(key):
            continue
        if len(keys) >= MAX_LIST_ENTRIES and key not in keys:
            truncated = sum(1 for t in tags[index:] if len(t) >= 2 and t[0] == "p")
            break
        keys.add(key)
    if truncated:
        USER_LISTS_BY["truncated"].inc()
    packed = pack_keys(keys)
    return UserList(
        event.pubkey, event.kind, event.created_at, event.id, packed, len(packed) // KEY_BYTES,
        truncated,
    )
