"""relay_label and redact_keys: a key a relay URL or a relay's text carries never survives."""

from __future__ import annotations

import pytest

from sigil_push.nostr.nip19 import encode_npub
from sigil_push.telemetry.redaction import redact_keys, relay_label

NPUB = encode_npub("cd" * 32)
HEX_KEY = "ef" * 32


@pytest.mark.parametrize(
    "url",
    [
        f"wss://filter.example/{NPUB}",
        f"wss://inbox.example/u/{HEX_KEY}?k={NPUB}",
        f"wss://{NPUB}.relay.example/",  # an npub is 63 characters: one DNS label
        f"wss://{NPUB.upper()}.relay.example",
        f"wss://{NPUB}@relay.example/",
        f"wss://relay.example/#{HEX_KEY}",
        f"wss://[{NPUB}/",  # not even a URL (urlsplit refuses it)
    ],
)
def test_no_part_of_a_relay_url_keeps_a_key(url: str) -> None:
    label = relay_label(url)
    assert NPUB not in label.lower() and HEX_KEY not in label.lower()
    assert "<key-" in label
    assert label == relay_label(url)  # one relay, one label while the process runs


def test_a_url_without_a_key_is_its_own_label() -> None:
    url = "wss://relay.damus.io/some/path?x=1"
    assert relay_label(url) == url


def test_redact_keys_keeps_the_words_around_a_key() -> None:
    text = redact_keys(f"restricted: pubkey {HEX_KEY.upper()} is not {NPUB}")
    assert text.startswith("restricted: pubkey <key-") and " is not <key-" in text
