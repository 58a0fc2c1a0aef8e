"""Which relays to watch for which keys, within the cap on connections.

Configured relays carry every key. A user's own relays (registration `relays`, kind 10050 or
10002 lists) carry only that user's keys; one connection per relay is shared by all keys that
want it. When more relays are wanted than `max_relays` allows, the relays wanted by the most
keys win and the rest are reported as skipped instead of silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import Gauge

SKIPPED = Gauge("sigil_push_relay_skipped_relays", "User relays not watched because of max_relays")
WATCHED = Gauge("sigil_push_relay_watched_relays", "Relays the bridge keeps a connection to")


class RelayPlan:
    """Pure bookkeeping of key → user relays and the resulting relay choice (no I/O)."""

    def __init__(self, configured: Sequence[str], max_relays: int) -> None:
        self.configured: tuple[str, ...] = tuple(dict.fromkeys(configured))
        self._configured_set = frozenset(self.configured)
        self._max_relays = max_relays
        self.own_relays: dict[str, frozenset[str]] = {}
        self.demand: dict[str, set[str]] = {}
        self.skipped: dict[str, int] = {}
        SKIPPED.set(0)
        WATCHED.set(0)

    def is_configured(self, url: str) -> bool:
        return url in self._configured_set

    def set_key(self, pubkey: str, relays: Iterable[str]) -> None:
        wanted = frozenset(relays) - self._configured_set
        before = self.own_relays.get(pubkey, frozenset())
        for url in before - wanted:
            holders = self.demand.get(url)
            if holders is not None:
                holders.discard(pubkey)
                if not holders:
                    del self.demand[url]
        for url in wanted - before:
            self.demand.setdefault(url, set()).add(pubkey)
        self.own_relays[pubkey] = wanted

    def remove_key(self, pubkey: str) -> None:
        self.set_key(pubkey, ())
        self.own_relays.pop(pubkey, None)

    def choose(self) -> list[str]:
        """Configured relays first, then user relays by how many keys want them."""
        room = max(0, self._max_relays - len(self.configured))
        ranked = sorted(self.demand, key=lambda url: (-len(self.demand[url]), url))
        chosen = list(self.configured) + ranked[:room]
        self.skipped = {url: len(self.demand[url]) for url in ranked[room:]}
        SKIPPED.set(len(self.skipped))
        WATCHED.set(len(chosen))
        return chosen

    def keys_on(self, url: str, all_keys: set[str]) -> set[str]:
        return all_keys if url in self._configured_set else self.demand.get(url, set())
