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
    return bytes(event_id), str(first), None if further is None else str(further)


def packed_catchup_rows(
    rows: Sequence[tuple[str, str, str, int]],
) -> list[tuple[str, bytes, bytes, int]]:
    """(relay, recipient, event id, created_at) as `catchup_items` stores them: the two ids
    as their bytes (migration 0014; the recipient UNADDRESSED, '', as an empty value)."""
    packed = bytes.fromhex
    return [(relay, packed(pubkey), packed(event_id), at) for relay, pubkey, event_id, at in rows]


def noted_catchup_rows(
    rows: Sequence[tuple[str, str, str, int]], noted_at: int
) -> list[tuple[str, bytes, bytes, int, int]]:
    """`packed_catchup_rows` with each row's `noted_at`, in one pass, for an engine that
    binds it per row. A second pass copying each packed row into a longer tuple
    (`(*row, noted_at)`) cost more than the packing itself, about 2 us a row on this machine:
    most of a four-relay flush's CPU on the event loop (bench/ingest_breakdown.py). Each
    distinct id is converted once: with every DM from several relays a flush holds each event
    id once per relay, and its recipients' keys once per DM (a flush's distinct ids are
    bounded by its rows)."""
    fromhex = bytes.fromhex
    packed: dict[str, bytes] = {}
    get = packed.get
    noted = []
    for relay, pubkey, event_id, at in rows:
        pubkey_bytes = get(pubkey)
        if pubkey_bytes is None:
            pubkey_bytes = packed[pubkey] = fromhex(pubkey)
        id_bytes = get(event_id)
        if id_bytes is None:
            id_bytes = packed[event_id] = fromhex(event_id)
        noted.append((relay, pubkey_bytes, id_bytes, at, noted_at))
    return noted


def packed_keys(pubkeys: Sequence[str]) -> list[bytes]:
    """Recipients as `catchup_items` stores them, to select by."""
    return [bytes.fromhex(pubkey) for pubkey in pubkeys]


def catchup_items(rows: Iterable[Any]) -> dict[str, int]:
    """(event_id, created_at) rows of `catchup_items`, by event id."""
    return {bytes(event_id).hex(): int(created_at) for event_id, created_at in rows}


def catchup_rows(rows: Iterable[Any]) -> list[tuple[str, str, int]]:
    """(pubkey, event_id, created_at) rows of `catchup_items`."""
    return [(bytes(pubkey).hex(), bytes(event_id).hex(), int(at))
            for pubkey, event_id, at in rows]
