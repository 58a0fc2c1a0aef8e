"""NIP-01 events: the fast parse and id paths accept and refuse exactly what the plain ones do.

`Event.from_json` validates with compiled patterns and one loop over the tags, the id preimage
is written by orjson and the signature checked by a direct libsecp256k1 call. These tests hold
each shortcut to the rule it replaces: the canonical serialisation byte for byte, every
malformed field refused, every altered byte of a signed event refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sigil_push.nostr.event import Event, InvalidEvent, compute_id, sign_event
from sigil_push.nostr.keys import SecretKey, schnorr_verify

KEY = SecretKey.generate()


def canonical(pubkey: str, created_at: int, kind: int, tags: Any, content: str) -> bytes:
    """NIP-01's serialisation written the slow, obvious way."""
    return json.dumps(
        [0, pubkey, created_at, kind, tags, content], separators=(",", ":"), ensure_ascii=False
    ).encode()


def signed(content: str = "hello", tags: tuple[tuple[str, ...], ...] = (("p", "ab" * 32),)) -> Event:
    return sign_event(KEY, 4, content, tags, 1_700_000_000)


# every code point Python can encode in UTF-8: controls, quotes, backslashes, U+2028, emoji
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=400, deadline=None)
@given(content=TEXT, tags=st.lists(st.lists(TEXT, max_size=4), max_size=4))
def test_the_id_preimage_is_the_canonical_serialisation(content: str, tags: list[list[str]]) -> None:
    """The id is the SHA-256 of exactly the bytes json.dumps writes in NIP-01's form, for any
    content and tags, and a signed event built from them verifies after a JSON round trip."""
    import hashlib

    frozen = tuple(tuple(t) for t in tags)
    expected = hashlib.sha256(canonical(KEY.public_key_hex, 5, 4, tags, content)).hexdigest()
    assert compute_id(KEY.public_key_hex, 5, 4, frozen, content) == expected
    event = sign_event(KEY, 4, content, frozen, 5)
    Event.from_json(json.loads(json.dumps(event.to_json()))).verify()


def test_a_lone_surrogate_has_no_id_and_is_invalid_not_an_error() -> None:
    """A relay can send "\\ud800" (valid JSON, no UTF-8 form): the event is refused as an id
    mismatch, never raised as an encoding error that would escape the reader."""
    raw = signed().to_json()
    raw["content"] = json.loads('"\\ud800"')
    event = Event.from_json(raw)
    with pytest.raises(InvalidEvent) as refused:
        event.verify()
    assert refused.value.reason == "id_mismatch"


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("id", "AB" * 32, "bad_id"),
        ("id", "ab" * 31, "bad_id"),
        ("id", "ab" * 32 + "\n", "bad_id"),
        ("pubkey", 7, "bad_pubkey"),
        ("pubkey", "g" * 64, "bad_pubkey"),
        ("sig", "ab" * 63, "bad_sig"),
        ("sig", "ab" * 64 + "00", "bad_sig"),
        ("created_at", 1.0, "bad_created_at"),
        ("created_at", True, "bad_created_at"),
        ("created_at", -1, "bad_created_at"),
        ("created_at", 2**53, "bad_created_at"),
        ("kind", 65536, "bad_kind"),
        ("kind", "4", "bad_kind"),
        ("content", None, "bad_content"),
        ("tags", {"p": "x"}, "bad_tags"),
        ("tags", [["p", 1]], "bad_tags"),
        ("tags", [("p", "x")], "bad_tags"),
        ("tags", ["p"], "bad_tags"),
    ],
)
def test_every_malformed_field_is_refused(field: str, value: Any, reason: str) -> None:
    raw = signed().to_json()
    raw[field] = value
    with pytest.raises(InvalidEvent) as refused:
        Event.from_json(raw)
    assert refused.value.reason == reason


def test_not_an_object_is_refused() -> None:
    for raw in ([], "x", None, 3):
        with pytest.raises(InvalidEvent):
            Event.from_json(raw)


def test_a_signed_event_verifies_and_any_altered_field_does_not() -> None:
    """Changing any signed field breaks the id; a new id over a changed field breaks the
    signature; another key's valid signature is still not this key's."""
    event = signed()
    Event.from_json(event.to_json()).verify()
    for field, value in (("content", "hellp"), ("created_at", 1_700_000_001), ("kind", 1059),
                         ("tags", [["p", "cd" * 32]])):
        raw = event.to_json()
        raw[field] = value
        with pytest.raises(InvalidEvent) as refused:
            Event.from_json(raw).verify()
        assert refused.value.reason == "id_mismatch"
        tags = tuple(tuple(t) for t in raw["tags"])
        raw["id"] = compute_id(raw["pubkey"], raw["created_at"], raw["kind"], tags, raw["content"])
        with pytest.raises(InvalidEvent) as forged:
            Event.from_json(raw).verify()
        assert forged.value.reason == "bad_signature"
    other = sign_event(SecretKey.generate(), 4, "hello", event.tags, event.created_at)
    raw = other.to_json()
    raw["pubkey"] = event.pubkey
    raw["id"] = event.id
    with pytest.raises(InvalidEvent):
        Event.from_json(raw).verify()


def test_schnorr_verify_refuses_malformed_keys_signatures_and_messages() -> None:
    event = signed()
    digest = bytes.fromhex(event.id)
    assert schnorr_verify(event.pubkey, digest, event.sig)
    flipped = event.sig[:-1] + ("0" if event.sig[-1] != "0" else "1")
    assert not schnorr_verify(event.pubkey, digest, flipped)
    assert not schnorr_verify(event.pubkey, digest, event.sig.upper())
    assert not schnorr_verify(event.pubkey, digest, event.sig[:-2])
    assert not schnorr_verify(event.pubkey, digest[:31], event.sig)
    assert not schnorr_verify(event.pubkey, digest + b"\0", event.sig)
    # x = 5 is not the x coordinate of any point on the curve
    assert not schnorr_verify(f"{5:064x}", digest, event.sig)
