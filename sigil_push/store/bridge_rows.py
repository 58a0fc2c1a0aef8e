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
    bytes (the recipient UNADDRESSED, '', as an empty value), and `noted_at`; in the order of
    the two ids joined (a keyed recipient's rows by event id, together).

    With every DM from several relays a flush holds each (recipient, event) once per relay:
    a row each was about 6 us of SQLite's CPU per relay's copy (a rowid and three index
    entries), most of what a further copy cost the bridge; merged here they are one row. A
    recipient's rows in key order walk the unique index's part for that key in order instead
    of a random page per row, and one order of the keys is the lock order in which
    PostgreSQL workers that overlap during a shard's hand-over upsert the same rows
    (opposite orders deadlock). The pass allocates a string per row and a tuple per DM
    only: a tuple and a list per row (tracked by the collector) cost the flush 3 us per
    event more with one relay (bench/ingest_breakdown.py). A row
    keeps the first `created_at` given for its id (they differ only when relays lied about an
    unverified, unaddressed id: that relay's next reconciliation fetches it once more). Each
    distinct id is converted once, in the same pass (a second pass copying each row into a
    longer tuple cost more than the packing itself)."""
    separator = CATCHUP_RELAY_SEPARATOR
    # keyed by the two ids joined (a string: nothing for the collector to track; a keyed
    # recipient's 64 characters or UNADDRESSED's none tell the join apart), holding the first
    # row given as it is: a copy-free pass when every DM came from one relay
    by_key: dict[str, tuple[str, str, str, int]] = {}
    get_row = by_key.get
    for row in rows:
        key = row[1] + row[2]
        kept = get_row(key)
        if kept is None:
            by_key[key] = row
        elif row[0] not in kept[0].split(separator):
            by_key[key] = (kept[0] + separator + row[0], kept[1], kept[2], kept[3])
    fromhex = bytes.fromhex
    packed: dict[str, bytes] = {}
    get = packed.get
    merged = []
    for key in sorted(by_key):
        relays, pubkey, event_id, at = by_key[key]
        pubkey_bytes = get(pubkey)
        if pubkey_bytes is None:
            pubkey_bytes = packed[pubkey] = fromhex(pubkey)
        merged.append((relays, pubkey_bytes, fromhex(event_id), at, noted_at))
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


def listed(relay: str) -> str:
    """`relay` as it appears in a row's relays padded with a separator at each end: what both
    engines' reads match first, so a relay's reads skip the other relays' rows in SQL
    (`catchup_rows` still checks each row it decodes)."""
    return f"{CATCHUP_RELAY_SEPARATOR}{relay}{CATCHUP_RELAY_SEPARATOR}"


def catchup_rows(rows: Iterable[Any], relay: str) -> list[tuple[str, str, int]]:
    """(recipient, event id, created_at) of the (relays, pubkey, event_id, created_at) rows of
    `catchup_items` that list `relay`."""
    return [(bytes(pubkey).hex(), bytes(event_id).hex(), int(at))
            for relays, pubkey, event_id, at in rows
            if relay in str(relays).split(CATCHUP_RELAY_SEPARATOR)]
