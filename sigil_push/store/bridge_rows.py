"""The bridge's rows as both engines read and write them: the row decoding and encoding that
`store.sqlite.bridge_state` and `store.postgres.bridge_state` share, kept in one place so the
two engines cannot drift apart in what they return; only their SQL differs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from sigil_push.store.interface import SeenRow
from sigil_push.store.records import StoredRelayList


def relay_pubkeys(rows: Iterable[Any]) -> list[tuple[str, str]]:
    """(relay, pubkey) rows of `relay_baselines`."""
    return [(str(relay), str(pubkey)) for relay, pubkey in rows]


def cursor_map(rows: Iterable[Any]) -> dict[str, int]:
    """(relay, live_until) rows of `relay_cursors`, by relay."""
    return {str(relay): int(live_until) for relay, live_until in rows}


def decode_relay_lists(rows: Iterable[Any]) -> list[StoredRelayList]:
    """(pubkey, kind, created_at, relays JSON) rows of `relay_lists`."""
    return [(str(p), int(k), int(c), tuple(json.loads(r))) for p, k, c, r in rows]


def encode_relay_lists(lists: Sequence[StoredRelayList]) -> list[tuple[str, int, int, str]]:
    """Relay lists as `relay_lists` rows (the relays as a JSON array)."""
    return [(p, k, c, json.dumps(list(r))) for p, k, c, r in lists]


def seen_row(row: Any) -> SeenRow:
    """(event id, first relay, further relay or NULL) of a `seen_events` join."""
    event_id, first, further = row
    return str(event_id), str(first), None if further is None else str(further)


RELAYS_SEPARATOR = " "
"""Joins the relays of one `catchup_deliveries` row (no URL has a space)."""


def relay_word(relay: str) -> str:
    """`relay` as it is found in a row's relays padded with the separator on both sides: a
    whole word of the list, never a prefix of a longer URL."""
    return f"{RELAYS_SEPARATOR}{relay}{RELAYS_SEPARATOR}"


def catchup_deliveries(
    rows: Iterable[tuple[str, str, str, int]],
) -> list[tuple[str, str, int, str]]:
    """(relay, recipient, event id, created_at) deliveries as `catchup_deliveries` rows:
    (recipient, event id, created_at, relays), one per recipient and event with every relay
    that delivered it joined, in the order each first appears (a relay listed once)."""
    grouped: dict[tuple[str, str], tuple[int, list[str]]] = {}
    for relay, pubkey, event_id, created_at in rows:
        found = grouped.get((pubkey, event_id))
        if found is None:
            grouped[pubkey, event_id] = (created_at, [relay])
        elif relay not in found[1]:
            found[1].append(relay)
    join = RELAYS_SEPARATOR.join
    return [
        (pubkey, event_id, created_at, join(relays))
        for (pubkey, event_id), (created_at, relays) in grouped.items()
    ]


def merged_relays(listed: str, more: str) -> str:
    """A row's relays with those of `more` not yet among them appended, each listed once:
    what an added delivery makes of a `catchup_deliveries` row that is already there."""
    relays = listed.split(RELAYS_SEPARATOR)
    for relay in more.split(RELAYS_SEPARATOR):
        if relay not in relays:
            relays.append(relay)
    return RELAYS_SEPARATOR.join(relays)


def catchup_items(rows: Iterable[Any]) -> dict[str, int]:
    """(event_id, created_at) rows of `catchup_deliveries`, by event id."""
    return {str(event_id): int(created_at) for event_id, created_at in rows}


def catchup_rows(rows: Iterable[Any]) -> list[tuple[str, str, int]]:
    """(pubkey, event_id, created_at) rows of `catchup_deliveries`."""
    return [(str(pubkey), str(event_id), int(at)) for pubkey, event_id, at in rows]
