"""BIP-340 keys: the only place that touches libsecp256k1.

Public keys are parsed once and cached because verification dominates ingest cost and the same
few thousand authors sign most events.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Any

import secp256k1

HEX_DIGITS = frozenset("0123456789abcdef")
_HEX128 = re.compile(r"[0-9a-f]{128}").fullmatch
_verify = secp256k1.lib.secp256k1_schnorrsig_verify
_context = secp256k1.secp256k1_ctx


def is_hex(value: str, length: int) -> bool:
    """True for exactly `length` lowercase hex digits (the only form NIP-01 allows)."""
    return len(value) == length and HEX_DIGITS.issuperset(value)


@lru_cache(maxsize=65536)
def _parsed_public_key(xonly_hex: str) -> Any:
    """libsecp256k1's parsed x-only key (its `secp256k1_xonly_pubkey`), None if not on the curve.

    The parse is a square root, so it is kept per key; the check itself is never cached.
    """
    try:
        return secp256k1.PublicKey(b"\x02" + bytes.fromhex(xonly_hex), raw=True).xonly_pubkey
    except Exception:  # noqa: BLE001 - libsecp256k1 raises bare Exception for off-curve points
        return None


def is_public_key(value: str) -> bool:
    """True for a BIP-340 public key: 64 lowercase hex digits that are the x coordinate of a
    point on the curve (about half of all 64-digit hex strings are not)."""
    return is_hex(value, 64) and _parsed_public_key(value) is not None


def schnorr_verify(xonly_hex: str, message32: bytes, signature_hex: str) -> bool:
    """Check a BIP-340 signature; any malformed key or signature is simply invalid.

    Calls `secp256k1_schnorrsig_verify` directly, as `PublicKey.schnorr_verify(message32, sig,
    None, raw=True)` does after its argument checks (made here: a 32-byte message, a 64-byte
    signature), which saves a third of the binding's Python cost per event.
    """
    public_key = _parsed_public_key(xonly_hex)
    if public_key is None or len(message32) != 32 or _HEX128(signature_hex) is None:
        return False
    return bool(_verify(_context, bytes.fromhex(signature_hex), message32, 32, public_key))


class SecretKey:
    """A secp256k1 secret key that signs Nostr events (the bridge's identity, test clients)."""

    __slots__ = ("_key", "public_key_hex")

    def __init__(self, secret_hex: str) -> None:
        if not is_hex(secret_hex, 64):
            raise ValueError("secret key must be 64 lowercase hex characters")
        self._key = secp256k1.PrivateKey(bytes.fromhex(secret_hex), raw=True)
        self.public_key_hex: str = self._key.pubkey.serialize()[1:].hex()

    @classmethod
    def generate(cls) -> SecretKey:
        return cls(os.urandom(32).hex())

    @property
    def secret_hex(self) -> str:
        return bytes(self._key.private_key).hex()

    def sign(self, message32: bytes) -> str:
        return bytes(self._key.schnorr_sign(message32, None, raw=True)).hex()

    def __repr__(self) -> str:
        return f"SecretKey(public_key_hex={self.public_key_hex!r})"
