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


CATCHUP_RELAY_SEPARATOR = " "
"""Joins the relays of one `catchup_items` row (migration 0016; no URL has a space)."""


def merged_catchup_rows(
    rows: Iterable[tuple[str, str, str, int]], noted_at: int
) -> list[tuple[str, bytes, bytes, int, int]]:
    """(relay, recipient, event id, created_at) deliveries as `catchup_items` rows: one per
    (recipient, event id), its relays joined (`CATCHUP_RELAY_SEPARATOR`), the two ids as their
    bytes (the recipient UNADDRESSED, '', as an empty value), and `noted_at`; in (recipient,
    event id) order.

    With every DM from several relays a flush holds each (recipient, event) once per relay:
    a row each was about 6 us of SQLite's CPU per relay's copy (a rowid and three index
    entries), most of what a further copy cost the bridge; merged here they are one row. A
    recipient's rows in key order walk the unique index's part for that key in order instead
    of a random page per row, and are the one lock order in which PostgreSQL workers that
    overlap during a shard's hand-over upsert the same rows (opposite orders deadlock). A row
    keeps the first `created_at` given for its id (they differ only when relays lied about an
    unverified, unaddressed id: that relay's next reconciliation fetches it once more). Each
    distinct id is converted once, in the same pass (a second pass copying each row into a
    longer tuple cost more than the packing itself)."""
    fromhex = bytes.fromhex
    by_key: dict[tuple[str, str], tuple[list[str], int]] = {}
    for relay, pubkey, event_id, at in rows:
        found = by_key.get((pubkey, event_id))
        if found is None:
            by_key[pubkey, event_id] = ([relay], at)
        elif relay not in found[0]:
            found[0].append(relay)
    packed: dict[str, bytes] = {}
    get = packed.get
    join = CATCHUP_RELAY_SEPARATOR.join
    merged = []
    for (pubkey, event_id), (relays, at) in sorted(by_key.items()):
        pubkey_bytes = get(pubkey)
        if pubkey_bytes is None:
            pubkey_bytes = packed[pubkey] = fromhex(pubkey)
        merged.append((join(relays), pubkey_bytes, fromhex(event_id), at, noted_at))
    return merged


def relays_union(kept: str, added: str) -> str:
    """A `catchup_items` row's relays with those of `added` not yet listed appended, in order:
    what a later flush's row for the same (recipient, DM) adds (SQLite calls it from the
    upsert; PostgreSQL's upsert computes the same in SQL)."""
    listed = kept.split(CATCHUP_RELAY_SEPARATOR)
    for relay in added.split(CATCHUP_RELAY_SEPARATOR):
        if relay not in listed:
            listed.append(relay)
    return CATCHUP_RELAY_SEPARATOR.join(listed)


def packed_keys(pubkeys: Sequence[str]) -> list[bytes]:
    """Recipients as `catchup_items` stores them, to select by."""
    return [bytes.fromhex(pubkey) for pubkey in pubkeys]


def catchup_rows(rows: Iterable[Any], relay: str) -> list[tuple[str, str, int]]:
    """(recipient, event id, created_at) of the (relays, pubkey, event_id, created_at) rows of
    `catchup_items` that list `relay`."""
    return [(bytes(pubkey).hex(), bytes(event_id).hex(), int(at))
            for relays, pubkey, event_id, at in rows
            if relay in str(relays).split(CATCHUP_RELAY_SEPARATOR)]
