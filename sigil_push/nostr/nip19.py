"""NIP-19 bech32 keys (npub/nsec), so users may give keys in the form their apps show."""

from __future__ import annotations

import bech32

from sigil_push.nostr.keys import is_hex


class InvalidKey(ValueError):
    """A key that is neither 64 lowercase hex characters nor a valid bech32 key of the kind asked."""


def _decode(value: str, prefix: str) -> str:
    hrp, data = bech32.bech32_decode(value)
    if hrp != prefix or data is None:
        raise InvalidKey(f"not a valid {prefix}")
    raw = bech32.convertbits(data, 5, 8, False)
    if raw is None or len(raw) != 32:
        raise InvalidKey(f"{prefix} must encode 32 bytes")
    return bytes(raw).hex()


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
