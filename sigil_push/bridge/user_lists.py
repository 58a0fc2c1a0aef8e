"""The users' own lists (issue 20): NIP-51 kind 10000 mute lists and NIP-02 kind 3 contact
lists, read where the bridge reads their kind 10050/10002 relay lists.

Only the public tags count (a mute list's private items are encrypted to the user): `p` keys,
and for a mute list `e` (muted threads) and `word` tags too (issue 32). A list is reduced here,
once verified, to what the store keeps: keys and ids packed 32 bytes each, at most
MAX_LIST_ENTRIES of each, and at most MAX_WORDS words, so one user's 100,000-tag list costs the
store and every later lookup no more than anyone's capped one.
"""

from __future__ import annotations

from sigil_push.bridge.metrics import USER_LISTS_BY
from sigil_push.nostr.event import Event
from sigil_push.nostr.kinds import MUTE_LIST, USER_LISTS
from sigil_push.store.preferences import UserList
from sigil_push.store.records import KEY_BYTES, pack_keys

USER_LIST_KINDS_SET = frozenset(USER_LISTS)
MAX_LIST_ENTRIES = 10_000
"""Keys (`p`) kept of a list, and muted threads (`e`) of a mute list."""
MAX_WORDS = 1_000
MAX_WORD_CHARS = 100
"""Muted words kept of a mute list, and the longest word kept: each kind 1 to the user is
searched for every word, so the list's cost per event stays bounded."""
_HEX = frozenset("0123456789abcdef")


def _hex64(value: str) -> bool:
    return len(value) == 64 and _HEX.issuperset(value)


def user_list_of(event: Event) -> UserList:
    """The stored form of a verified kind 10000 or 3: its first MAX_LIST_ENTRIES distinct
    valid `p` keys and, for a mute list (NIP-51), its first MAX_LIST_ENTRIES `e` ids (muted
    threads) and MAX_WORDS `word` tags (case-folded, at most MAX_WORD_CHARS each); the tags
    past a cap, and words too long, are counted as truncated and not kept."""
    keys: set[str] = set()
    threads: set[str] = set()
    words: dict[str, None] = {}
    truncated = 0
    mute = event.kind == MUTE_LIST
    for tag in event.tags:
        if len(tag) < 2:
            continue
        name, value = tag[0], tag[1]
        if name == "p":
            kept = keys
        elif mute and name == "e":
            kept = threads
        elif mute and name == "word":
            word = value.strip().casefold()
            if not word or "\n" in word:
                continue
            if len(word) > MAX_WORD_CHARS or (len(words) >= MAX_WORDS and word not in words):
                truncated += 1
            else:
                words[word] = None
            continue
        else:
            continue
        if not _hex64(value):
            continue
        if len(kept) >= MAX_LIST_ENTRIES and value not in kept:
            truncated += 1
            continue
        kept.add(value)
    if truncated:
        USER_LISTS_BY["truncated"].inc()
    packed = pack_keys(keys)
    packed_threads = pack_keys(threads)
    return UserList(
        event.pubkey, event.kind, event.created_at, event.id, packed,
        len(packed) // KEY_BYTES + len(packed_threads) // KEY_BYTES + len(words), truncated,
        packed_threads, "\n".join(words),
    )
