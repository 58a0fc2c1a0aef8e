"""NIP-19 bech32 keys (npub/nsec), so users may give keys in the form their apps show."""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable

import bech32

from sigil_push.nostr.keys import is_hex


class InvalidKey(ValueError):
    """A key that is neither 64 lowercase hex characters nor a valid bech32 key of the kind asked."""


_CHARSET = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"
_VALUES = {c: i for i, c in enumerate(_CHARSET)}
_GENERATOR = (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)
_SHIFTED_OUT = tuple(
    functools.reduce(operator.xor, (g for i, g in enumerate(_GENERATOR) if top >> i & 1), 0)
    for top in range(32)
)
"""BIP-173's checksum step for each value of the five bits it shifts out, XORed in one go."""


def _polymod(state: int, values: Iterable[int]) -> int:
    for value in values:
        state = ((state & 0x1FFFFFF) << 5) ^ value ^ _SHIFTED_OUT[state >> 25]
    return state


@functools.cache
def _prefix_state(prefix: str) -> int:
    """The checksum state after the expanded human-readable part (the same for every key)."""
    return _polymod(1, [ord(c) >> 5 for c in prefix] + [0] + [ord(c) & 31 for c in prefix])


def _decode(value: str, prefix: str) -> str:
    """A BIP-173 bech32 string of `prefix` holding 32 bytes, as hex.

    The `bech32` package does the same a bit at a time in Python: 52 µs a key, so a private
    mute list of 1,000 npubs cost 50 ms of the event loop. Here the checksum takes one table
    step per character and the 5-to-8-bit conversion is one integer: about a tenth of that
    (tests/test_nip19.py checks it against the package on valid and broken keys alike)."""
    if len(value) > 90 or (value != value.lower() and value != value.upper()):
        raise InvalidKey(f"not a valid {prefix}")
    text = value.lower()
    split = text.rfind("1")
    if text[:split] != prefix or split + 7 > len(text):
        raise InvalidKey(f"not a valid {prefix}")
    try:
        data = [_VALUES[c] for c in text[split + 1 :]]
    except KeyError:
        raise InvalidKey(f"not a valid {prefix}") from None
    if _polymod(_prefix_state(prefix), data) != 1:
        raise InvalidKey(f"not a valid {prefix}")
    payload = data[:-6]
    bits = 5 * len(payload)
    if bits // 8 != 32:
        raise InvalidKey(f"{prefix} must encode 32 bytes")
    number = 0
    for group in payload:
        number = number << 5 | group
    spare = bits % 8
    if spare >= 5 or number & ((1 << spare) - 1):
        raise InvalidKey(f"{prefix} must encode 32 bytes")
    return (number >> spare).to_bytes(32, "big").hex()


def _encode(prefix: str, key_hex: str) -> str:
    data = bech32.convertbits(bytes.fromhex(key_hex), 8, 5, True)
    if data is None:
        raise InvalidKey("cannot encode key")
    return str(bech32.bech32_encode(prefix, data))


def parse_public_key(value: str) -> str:
    """Accept `npub1…` or 64 lowercase hex and return the hex public key."""
    if is_hex(value, 64):
        return value
    if value[:5].lower() == "npub1":
        return _decode(value, "npub")
    raise InvalidKey("expected npub1… or 64 lowercase hex characters")


def parse_secret_key(value: str) -> str:
    """Accept `nsec1…` or 64 lowercase hex and return the hex secret key."""
    if is_hex(value, 64):
        return value
    if value[:5].lower() == "nsec1":
        return _decode(value, "nsec")
    raise InvalidKey("expected nsec1… or 64 lowercase hex characters")


def encode_npub(public_key_hex: str) -> str:
    return _encode("npub", public_key_hex)


def encode_note(event_id_hex: str) -> str:
    """NIP-19 `note1…` of an event id (what a notification's link names)."""
    return _encode("note", event_id_hex)
