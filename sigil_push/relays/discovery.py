"""The recipients' own DM relays: NIP-17 kind 10050 lists, else NIP-65 kind 10002 read relays.

Senders of NIP-17 DMs publish to the recipient's kind 10050 list, so the bridge must watch
those relays too. Lists arrive on the configured relays (the bridge asks for them in the same
REQ as the DMs) and are replaceable: only the newest per (key, kind) counts. They are kept in
the database so a restart subscribes to the right relays before any list is fetched again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from sigil_push.hosts import InvalidHost, canonical_host, check_host
from sigil_push.nostr.event import Event
from sigil_push.nostr.kinds import CONTACTS, DM_RELAY_LISTS, DM_RELAYS, MUTE_LIST, RELAY_LIST
from sigil_push.store.interface import RelayStateStore
from sigil_push.telemetry.memory_gauges import track

LIST_KINDS_SET = frozenset(DM_RELAY_LISTS)
UNFILTERED_LIST_KINDS = (*DM_RELAY_LISTS, MUTE_LIST)
"""The lists asked for of every key: its relay lists and its mute list."""
SUBSCRIBED_LIST_KINDS = (*UNFILTERED_LIST_KINDS, CONTACTS)
"""What the bridge asks for by author: the relay lists, and the users' mute (NIP-51 kind 10000)
and contact (kind 3) lists that decide what wakes them (issue 20). The kind 3, often of
thousands of keys, only of keys with a follows-only pair (the only rule that reads it)."""
SUBSCRIBED_LIST_KINDS_SET = frozenset(SUBSCRIBED_LIST_KINDS)
MAX_RELAYS_PER_LIST = 10
MAX_URL_LENGTH = 256


def normalize_relay_url(url: str, allow_insecure: bool) -> str | None:
    """A canonical `wss://host[:port][/path]` form, or None for anything not acceptable.

    User-supplied relays (registration, lists) must be wss://; ws:// only when the operator
    allows insecure relays (tests). Canonical forms make one relay one connection: the query
    is dropped (and a default port too), so `?x=1` variants of one relay are one URL, not a way
    to open `max_relays` connections to one server; the outbound guard also caps connections
    per host for what differs by path. The host must be one DNS can carry and, unless insecure
    relays are allowed (tests), not a literal non-public address (sigil_push/hosts.py).
    """
    if not isinstance(url, str) or len(url) > MAX_URL_LENGTH or any(c.isspace() for c in url):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("ws", "wss") or (scheme == "ws" and not allow_insecure):
        return None
    if not parts.hostname or parts.username or parts.password or parts.fragment:
        return None
    host = canonical_host(parts.hostname)
    try:
        check_host(host, allow_private=allow_insecure)
    except InvalidHost:
        return None
    if ":" in host:
        host = f"[{host}]"
    default_port = 443 if scheme == "wss" else 80
    netloc = f"{host}:{port}" if port is not None and port != default_port else host
    path = parts.path.rstrip("/")
    return f"{scheme}://{netloc}{path}"


def relays_in_list(event: Event, allow_insecure: bool) -> tuple[str, ...]:
    """The DM relays a kind 10050 or 10002 event names, normalised, deduplicated, capped."""
    found: list[str] = []
    for tag in event.tags:
        if len(tag) < 2:
            continue
        if event.kind == DM_RELAYS and tag[0] == "relay":
            wanted = True
        elif event.kind == RELAY_LIST and tag[0] == "r":
            wanted = len(tag) < 3 or tag[2] in ("", "read")
        else:
            wanted = False
        url = normalize_relay_url(tag[1], allow_insecure) if wanted else None
        if url and url not in found:
            found.append(url)
        if len(found) >= MAX_RELAYS_PER_LIST:
            break
    return tuple(found)


class RelayLists:
    """The newest 10050/10002 list of each registered key, in memory and in the database."""

    def __init__(self, state: RelayStateStore, allow_insecure: bool) -> None:
        self._state = state
        self._allow_insecure = allow_insecure
        self._lists: dict[tuple[str, int], tuple[int, tuple[str, ...]]] = {}
        track("relay_lists", self, lambda r: len(r._lists))
        self._unsaved: dict[tuple[str, int], tuple[int, tuple[str, ...]]] = {}
        self._listeners: list[Callable[[str], None]] = []

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """Be told the key whose DM relays a newer list changed (`offer`)."""
        self._listeners.append(listener)

    async def load(self) -> None:
        for pubkey, kind, created_at, relays in await self._state.relay_lists():
            self._lists[(pubkey, kind)] = (created_at, relays)

    def relays_of(self, pubkey: str) -> tuple[str, ...]:
        """NIP-17 says DMs go to the 10050 relays; NIP-65 read relays are the fallback."""
        dm = self._lists.get((pubkey, DM_RELAYS))
        if dm is not None:
            return dm[1]
        general = self._lists.get((pubkey, RELAY_LIST))
        return general[1] if general is not None else ()

    def offer(self, event: Event) -> bool:
        """Take a verified list event; True (and the listeners told) when the key's DM relays
        changed."""
        slot = (event.pubkey, event.kind)
        current = self._lists.get(slot)
        if current is not None and current[0] >= event.created_at:
            return False
        before = self.relays_of(event.pubkey)
        entry = (event.created_at, relays_in_list(event, self._allow_insecure))
        self._lists[slot] = entry
        self._unsaved[slot] = entry
        if self.relays_of(event.pubkey) == before:
            return False
        for listener in self._listeners:
            listener(event.pubkey)
        return True

    def forget(self, pubkeys: Iterable[str]) -> list[str]:
        gone = [
            p
            for p in pubkeys
            if (p, DM_RELAYS) in self._lists or (p, RELAY_LIST) in self._lists
        ]
        for pubkey in gone:
            for kind in (DM_RELAYS, RELAY_LIST):
                self._lists.pop((pubkey, kind), None)
                self._unsaved.pop((pubkey, kind), None)
        return gone

    async def save(self) -> None:
        """Write the lists taken since the last save, in key order: workers that overlap on
        keys during a hand-over save the same keys' lists, and in their own arrival orders each
        could lock a row the other waits for (a deadlock PostgreSQL settles by aborting one).

        Lists a failed write did not store stay to be saved next time (a newer list of the same
        key taken meanwhile wins): they are what another worker, or this one after a restart,
        reads to find the users' inbox relays."""
        unsaved, self._unsaved = self._unsaved, {}
        if unsaved:
            try:
                await self._state.save_relay_lists(
                    [(p, k, c, r) for (p, k), (c, r) in sorted(unsaved.items())]
                )
            except BaseException:
                # not a key forgotten meanwhile (`forget` could not take it out of `unsaved`)
                kept = {slot: entry for slot, entry in unsaved.items() if slot in self._lists}
                self._unsaved = kept | self._unsaved
                raise
