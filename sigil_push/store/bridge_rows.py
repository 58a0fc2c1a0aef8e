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


def catchup_items(rows: Iterable[Any]) -> dict[str, int]:
    """(event_id, created_at) rows of `catchup_items`, by event id."""
    return {str(event_id): int(created_at) for event_id, created_at in rows}


def catchup_rows(rows: Iterable[Any]) -> list[tuple[str, str, int]]:
    """(pubkey, event_id, created_at) rows of `catchup_items`."""
    return [(str(pubkey), str(event_id), int(at)) for pubkey, event_id, at in rows]
