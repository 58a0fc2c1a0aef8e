"""NIP-19 keys: sigil-push's own bech32 decoder (a table step per character, issue 34) agrees
with the `bech32` package, an independent implementation of BIP-173, on valid keys and on
every way a key can be broken, and with nostr-sdk on what a valid npub holds."""

from __future__ import annotations

import secrets

import bech32
import nostr_sdk
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sigil_push.nostr.nip19 import InvalidKey, encode_npub, parse_public_key, parse_secret_key

CHARSET = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"


def _package(value: str, prefix: str) -> str | None:
    """What the `bech32` package decodes `value` to (None: refused)."""
    hrp, data = bech32.bech32_decode(value)
    if hrp != prefix or data is None:
        return None
    raw = bech32.convertbits(data, 5, 8, False)
    return bytes(raw).hex() if raw is not None and len(raw) == 32 else None


def _ours(value: str) -> str | None:
    try:
        return parse_public_key(value)
    except InvalidKey:
        return None


def test_valid_npubs_decode_as_nostr_sdk_encodes_them() -> None:
    for _ in range(200):
        key = nostr_sdk.Keys.generate().public_key()
        npub = str(key.to_bech32())
        assert parse_public_key(npub) == key.to_hex()
        assert parse_public_key(npub.upper()) == key.to_hex()
        assert encode_npub(key.to_hex()) == npub


def _broken() -> list[str]:
    npub = encode_npub(secrets.token_hex(32))
    body = npub[5:]
    flipped = CHARSET[(CHARSET.index(body[10]) + 1) % 32]
    letter = next(i for i in range(6, len(npub)) if npub[i].isalpha())
    return [
        npub[:-1] + ("q" if npub[-1] != "q" else "p"),     # checksum
        npub[:15] + flipped + npub[16:],                   # a data character
        npub[:letter] + npub[letter].upper() + npub[letter + 1 :],  # mixed case
        npub.replace("npub1", "nsec1"),                    # another prefix
        npub[:30] + "b" + npub[31:],                       # outside the charset
        npub + "q",                                        # too long for its checksum
        npub[:40],                                         # too short
        str(bech32.bech32_encode("npub", bech32.convertbits(secrets.token_bytes(31), 8, 5))),
        str(bech32.bech32_encode("npub", bech32.convertbits(secrets.token_bytes(33), 8, 5))),
        # 52 groups whose 4 spare bits are not zero
        str(bech32.bech32_encode("npub", [*bech32.convertbits(secrets.token_bytes(32), 8, 5)[:-1], 31])),
        "npub1", "npub1" + "q" * 90, "npub1ü" + body[1:],
    ]


@pytest.mark.parametrize("case", range(13))
def test_broken_npubs_are_refused_as_the_package_refuses_them(case: int) -> None:
    for _ in range(20):
        value = _broken()[case]
        assert _ours(value) == _package(value, "npub"), value
        assert _ours(value) is None


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="npub1" + CHARSET + "QPZRYB", min_size=5, max_size=80))
def test_any_text_decodes_as_the_package_decodes_it(text: str) -> None:
    value = "npub1" + text if not text.lower().startswith("npub1") else text
    assert _ours(value) == _package(value, "npub")


def test_secret_keys_decode_too() -> None:
    keys = nostr_sdk.Keys.generate()
    assert parse_secret_key(str(keys.secret_key().to_bech32())) == keys.secret_key().to_hex()
