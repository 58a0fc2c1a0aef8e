"""What an Iris push carries (CONTRACT 3b), from real signed events (nostr-sdk): titles by
kind, bodies, names and icons for Web Push only, the 4,096-byte record rule, and the APNs/FCM
keys that say nothing about a public event."""

from __future__ import annotations

import json
from typing import Any

import nostr_sdk

from sigil_push.iris.payload import (
    UNKNOWN_PROFILE,
    Profile,
    event_url,
    kind_title,
    profile_of,
    provider_data,
    web_push_body,
    zap_sats,
)
from sigil_push.push.iris_senders import MAX_BODY_BYTES
from sigil_push.push.unifiedpush_sender import AES128GCM_OVERHEAD

URL = "https://iris.to/"
ALICE = nostr_sdk.Keys.generate()


def signed(kind: int, content: str, tags: list[list[str]] | None = None,
           keys: nostr_sdk.Keys = ALICE) -> dict[str, Any]:
    event = (
        nostr_sdk.EventBuilder(nostr_sdk.Kind(kind), content)
        .tags([nostr_sdk.Tag.parse(tag) for tag in tags or []])
        .finalize(keys)
    )
    return dict(json.loads(event.as_json()))


def zap(request_tags: list[list[str]], bolt11: str, comment: str = "great post") -> dict[str, Any]:
    request = signed(9734, comment, request_tags, nostr_sdk.Keys.generate())
    return signed(9735, "", [["p", "b" * 64], ["bolt11", bolt11],
                             ["description", json.dumps(request)]], nostr_sdk.Keys.generate())


def shown(event: dict[str, Any], profile: Profile = UNKNOWN_PROFILE) -> dict[str, Any]:
    return dict(json.loads(web_push_body(event, profile, URL, MAX_BODY_BYTES)))


def test_titles_by_kind() -> None:
    assert kind_title(signed(1, "hi", [["p", "b" * 64]])) == "Mention"
    assert kind_title(signed(1, "hi", [["e", "c" * 64, "", "reply"], ["p", "b" * 64]])) == "Reply"
    assert kind_title(signed(6, "")) == kind_title(signed(16, "")) == "Repost"
    assert kind_title(signed(7, "+")) == "Reaction"
    assert kind_title(signed(4, "ciphertext?iv=x")) == "DM"
    assert kind_title(signed(1060, "ciphertext")) == "DM"
    assert kind_title(signed(30023, "an article")) == "Notification"


def test_a_zap_title_names_its_amount_from_the_request_else_the_invoice() -> None:
    assert zap_sats(zap([["amount", "21000"], ["p", "b" * 64]], "lnbc1u1pxyz")) == 21
    assert kind_title(zap([["p", "b" * 64]], "lnbc210n1pxyz")) == "Zap of 21 sats"
    assert kind_title(zap([["p", "b" * 64]], "lnbc2m1pxyz")) == "Zap of 200,000 sats"
    assert kind_title(zap([["p", "b" * 64]], "not an invoice")) == "Zap"
    assert kind_title(zap([["amount", "21000"]], "lnbc1"), generic=True) == "Zap"


def test_web_push_carries_the_event_name_icon_body_and_url() -> None:
    note = signed(1, "x" * 300, [["p", "b" * 64]])
    data = shown(note, Profile("alice", "https://pics.example/a.png"))
    assert data == {
        "event": note, "title": "Mention from alice", "body": "x" * 140,
        "icon": "https://pics.example/a.png", "url": URL + nostr_sdk.EventId.parse(note["id"]).to_bech32(),
    }
    assert data["url"] == event_url(URL, note["id"]) and data["url"].startswith(URL + "note1")
    comment = shown(zap([["amount", "5000"]], "lnbc1", "thanks!"))
    assert comment["title"] == "Zap of 5 sats" and comment["body"] == "thanks!"
    assert "icon" not in comment


def test_encrypted_kinds_have_no_body_name_or_icon() -> None:
    dm = signed(1060, "secret ciphertext")
    data = shown(dm, Profile("alice", "https://pics.example/a.png"))
    assert data["event"] == dm
    assert (data["title"], data["body"]) == ("DM", "")
    assert "icon" not in data


def test_an_event_whose_record_would_pass_4096_bytes_becomes_a_pointer() -> None:
    big = signed(1, "y" * 5000, [["p", "b" * 64]])
    body = web_push_body(big, Profile("a" * 64, "https://p.example/" + "z" * 1000), URL, MAX_BODY_BYTES)
    assert json.loads(body)["event"] == {"id": big["id"], "author": big["pubkey"], "kind": 1}
    assert len(body) + AES128GCM_OVERHEAD <= 4096
    small = signed(1, "y" * 3000, [["p", "b" * 64]])
    assert shown(small)["event"] == small


def test_apns_and_fcm_keys_carry_an_event_only_for_ciphertext_kinds() -> None:
    note = signed(1, "public words", [["p", "b" * 64]])
    data = provider_data(note, URL)
    assert data == {"title": "Mention", "body": "", "url": URL}, "no id that finds the note"
    assert "public words" not in json.dumps(data) and note["pubkey"] not in json.dumps(data)
    dm = signed(1059, "wrapped")
    assert json.loads(provider_data(dm, URL)["event"]) == dm
    assert provider_data(dm, URL)["url"] == event_url(URL, dm["id"])
    assert provider_data(zap([["amount", "21000"]], "lnbc1"), URL)["title"] == "Zap"
    assert all(isinstance(value, str) for value in provider_data(dm, URL).values())


def test_a_profile_shows_a_bounded_name_and_only_an_https_picture() -> None:
    assert profile_of('{"name": "alice", "picture": "https://p.example/a.png"}') == Profile(
        "alice", "https://p.example/a.png"
    )
    assert profile_of('{"display_name": "Alice A", "name": "alice"}').name == "Alice A"
    assert profile_of('{"name": "x", "picture": "http://p.example/a.png"}').picture is None
    assert profile_of('{"name": "' + "n" * 500 + '"}').name == "n" * 64
    assert profile_of('{"name": "a\\u0000b\\nc"}').name == "abc"
    assert profile_of("not json") == UNKNOWN_PROFILE
    assert profile_of('["a list"]') == UNKNOWN_PROFILE
