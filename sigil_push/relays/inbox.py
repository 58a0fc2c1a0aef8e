"""A recipient's inbox relays, in NIP-17's order, for the observation log's `expect` records.

NIP-17 senders publish a DM to the recipient's kind 10050 relays; without that list, clients
fall back to the NIP-65 (kind 10002) read relays; the bridge's last resort is the relays the
user named at registration. Only the first non-empty source counts: a relay the sender had no
reason to use must not count as having missed the DM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache

from sigil_push.relays.discovery import RelayLists, normalize_relay_url


def inbox_relays(
    lists: RelayLists, pubkey: str, registration: Sequence[str], allow_insecure: bool
) -> tuple[str, ...]:
    """Kind 10050, else NIP-65 read relays (both via `RelayLists`), else registration relays."""
    listed = lists.relays_of(pubkey)
    if listed:
        return listed
    return _normalized(tuple(registration), allow_insecure)


@lru_cache(maxsize=4096)
def _normalized(registration: tuple[str, ...], allow_insecure: bool) -> tuple[str, ...]:
    """Cached: this runs for every DM handled, and most users name the same few relays."""
    normalized = (normalize_relay_url(url, allow_insecure) for url in registration)
    return tuple(dict.fromkeys(url for url in normalized if url))


def connected_inboxes(
    recipients: Iterable[str],
    lists: RelayLists,
    registrations: Mapping[str, Sequence[str]],
    allow_insecure: bool,
    connected: Callable[[str], bool],
) -> list[str]:
    """The inbox relays of any of `recipients` that `connected` says are connected, sorted."""
    relays = {
        url
        for pubkey in recipients
        for url in inbox_relays(lists, pubkey, registrations.get(pubkey, ()), allow_insecure)
    }
    return sorted(url for url in relays if connected(url))
