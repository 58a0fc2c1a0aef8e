"""The observation log's hand-encoded `seen` and `expect` records are the JSON the dict path
writes: same fields, same values, valid JSON whatever a relay URL holds, and a field of an
unexpected type takes the general encoder instead of being spliced into the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sigil_push.nostr.nip19 import encode_npub
from sigil_push.observations import _KNOWN_PLATFORMS, _KNOWN_STATUSES, _PLAIN_WORD, ObservationLog
from sigil_push.telemetry.redaction import relay_label

EVENT_ID = "ab" * 32
TS = 1_790_000_000_123


async def written(folder: Path, fill: Any) -> list[dict[str, Any]]:
    log = ObservationLog(folder)
    await log.start()
    fill(log)
    await log.stop()
    return [
        json.loads(line)
        for path in sorted(folder.glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


@pytest.mark.asyncio
async def test_a_batch_of_seen_records_is_one_record_per_relay_delivery(tmp_path: Path) -> None:
    odd = 'wss://relay.example/"quoted"\\path\u2028é'
    records = await written(
        tmp_path,
        lambda log: log.seen_many(
            [("wss://a", EVENT_ID, 4, 1_790_000_000, TS), (odd, EVENT_ID, 1059, 5, TS + 1)]
        ),
    )
    assert records == [
        {"type": "seen", "ts": TS, "relay": "wss://a", "event_id": EVENT_ID, "kind": 4,
         "created_at": 1_790_000_000},
        {"type": "seen", "ts": TS + 1, "relay": odd, "event_id": EVENT_ID, "kind": 1059,
         "created_at": 5},
    ]


@pytest.mark.asyncio
async def test_fields_of_other_types_are_encoded_not_spliced(tmp_path: Path) -> None:
    """An id that is not 64 lowercase hex digits (here one that would close the string and add
    a field) or a non-integer kind goes through the JSON encoder."""
    sneaky = 'x","pubkey":"' + "cd" * 32
    records = await written(
        tmp_path,
        lambda log: (
            log.seen_many([("wss://a", sneaky, 4, 1, TS), ("wss://a", EVENT_ID, "4", 1, TS)]),  # type: ignore[list-item]
            log.expect(TS, sneaky, ["wss://a"]),
        ),
    )
    assert [r["event_id"] for r in records] == [sneaky, EVENT_ID, sneaky]
    assert records[1]["kind"] == "4"
    assert all("pubkey" not in r for r in records)


@pytest.mark.asyncio
async def test_every_relays_record_of_an_id_is_checked_as_that_id(tmp_path: Path) -> None:
    """The relays' records of one event share its id, checked once for them: an id that
    follows a good one, or repeats right after itself, is still encoded, never spliced."""
    sneaky = 'x","pubkey":"' + "cd" * 32
    records = await written(
        tmp_path,
        lambda log: log.seen_many([
            ("wss://a", EVENT_ID, 4, 1, TS), ("wss://b", EVENT_ID, 4, 1, TS),
            ("wss://c", sneaky, 4, 1, TS), ("wss://d", sneaky, 4, 1, TS),
            ("wss://e", EVENT_ID, 4, 1, TS),
        ]),
    )
    assert [(r["relay"], r["event_id"]) for r in records] == [
        ("wss://a", EVENT_ID), ("wss://b", EVENT_ID), ("wss://c", sneaky), ("wss://d", sneaky),
        ("wss://e", EVENT_ID),
    ]
    assert all("pubkey" not in r for r in records)


@pytest.mark.asyncio
async def test_expect_records_carry_the_relay_list(tmp_path: Path) -> None:
    relays = ["wss://a", 'wss://b/"x"']
    records = await written(
        tmp_path,
        lambda log: (
            log.expect(TS, EVENT_ID, relays),
            log.expect(TS + 1, EVENT_ID, relays),
            log.expect(TS + 2, EVENT_ID, []),
        ),
    )
    assert records == [
        {"type": "expect", "ts": TS, "event_id": EVENT_ID, "relays": relays},
        {"type": "expect", "ts": TS + 1, "event_id": EVENT_ID, "relays": relays},
        {"type": "expect", "ts": TS + 2, "event_id": EVENT_ID, "relays": []},
    ]


@pytest.mark.asyncio
async def test_a_burst_of_push_records_is_the_dict_paths_json(tmp_path: Path) -> None:
    """Delivery hands a burst of answers over in one call: one record per wakeup, stamped with
    the burst's time, the same JSON the dict path writes, and nothing but the record's fields;
    an id or a name that would need escaping goes through the JSON encoder."""
    sneaky = 'x","pubkey":"' + "cd" * 32
    records = await written(
        tmp_path,
        lambda log: log.push_many(
            [(EVENT_ID, "ios", "accepted", 12), (sneaky, "android", "retry", 3),
             (EVENT_ID, 'ios","npub":"npub1x', "accepted", 5)],
            TS,
        ),
    )
    assert records == [
        {"type": "push", "ts": TS, "event_id": EVENT_ID, "platform": "ios", "status": "accepted",
         "latency_ms": 12},
        {"type": "push", "ts": TS, "event_id": sneaky, "platform": "android", "status": "retry",
         "latency_ms": 3},
        {"type": "push", "ts": TS, "event_id": EVENT_ID, "platform": 'ios","npub":"npub1x',
         "status": "accepted", "latency_ms": 5},
    ]
    assert all(set(r) == {"type", "ts", "event_id", "platform", "status", "latency_ms"}
               for r in records)


def test_the_names_push_records_splice_unchecked_are_plain_words() -> None:
    """Known platforms and statuses skip the pattern check: they must pass it."""
    assert _KNOWN_PLATFORMS and _KNOWN_STATUSES
    assert all(_PLAIN_WORD(name) for name in _KNOWN_PLATFORMS | _KNOWN_STATUSES)


@pytest.mark.asyncio
async def test_unknown_push_names_are_still_checked(tmp_path: Path) -> None:
    """A platform or status outside the known sets is spliced only if it is a plain word."""
    records = await written(
        tmp_path,
        lambda log: log.push_many(
            [(EVENT_ID, "webos", "deferred", 1), (EVENT_ID, "ios", 'ok","npub":"x', 2),
             (EVENT_ID, ["ios"], "accepted", 3)],  # type: ignore[list-item]
            TS,
        ),
    )
    assert [(r["platform"], r["status"]) for r in records] == [
        ("webos", "deferred"), ("ios", 'ok","npub":"x'), (["ios"], "accepted")
    ]
    assert all("npub" not in r for r in records)


@pytest.mark.asyncio
async def test_no_record_names_a_user_through_a_relay_url(tmp_path: Path) -> None:
    """A relay URL can carry a user's key (`wss://filter.nostr.wine/npub1…`, inbox services
    keyed by hex pubkey): the bridge hands its records the connection's URL as it is, so the
    log writes every relay as its `relay_label`, on the spliced and the encoded paths alike,
    and one relay is one string across the record types (analytics joins them)."""
    npub = encode_npub("cd" * 32)
    hex_key = "ef" * 32
    by_npub = f"wss://filter.example/{npub}"
    by_hex = f"wss://inbox.example/u/{hex_key}?k={npub}"
    records = await written(
        tmp_path,
        lambda log: (
            log.seen_many([(by_npub, EVENT_ID, 1059, 5, TS), (by_hex, EVENT_ID, 1059, 5, TS)]),
            log.seen(by_npub, "not-hex", 1059, 5, TS),
            log.expect(TS, EVENT_ID, [by_npub, by_hex]),
            log.expect(TS, "not-hex", [by_hex]),
            log.relay_state(by_npub, "connected"),
            log.canary(TS, by_hex, EVENT_ID, True, "", 12),
        ),
    )
    text = json.dumps(records)
    assert npub not in text and hex_key not in text
    assert {r["type"] for r in records} == {"seen", "expect", "relay", "canary"}
    names = [r["relay"] for r in records if "relay" in r]
    names += [relay for r in records for relay in r.get("relays", [])]
    assert set(names) == {relay_label(by_npub), relay_label(by_hex)}
    assert relay_label(by_npub).startswith("wss://filter.example/<key-")


@pytest.mark.asyncio
async def test_relay_free_text_in_a_record_names_no_key(tmp_path: Path) -> None:
    """A canary record's `ok_message` is the relay's own OK text, and a `relay` record's
    `detail` may quote a relay's message: relays word refusals as they like, some quoting the
    pubkey they refuse (`restricted: pubkey <hex> not admitted`). A key in them is written
    as the digest relay labels use; the rest of the text stays readable."""
    npub = encode_npub("cd" * 32)
    hex_key = "EF" * 32
    records = await written(
        tmp_path,
        lambda log: (
            log.canary(TS, "wss://a", EVENT_ID, False, f"restricted: pubkey {hex_key} no", None),
            log.relay_state("wss://a", "auth_required", f"blocked {npub}"),
        ),
    )
    text = json.dumps(records)
    assert npub not in text and hex_key not in text and hex_key.lower() not in text
    assert records[0]["ok_message"].startswith("restricted: pubkey <key-")
    assert records[0]["ok_message"].endswith("> no")
    assert records[1]["detail"].startswith("blocked <key-")
