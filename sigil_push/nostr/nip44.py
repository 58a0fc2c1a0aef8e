"""NIP-44 v2 encryption, as the bridge seals previews to a device key (issue 21).

The sealing side only: the bridge never decrypts a NIP-44 payload of its own. Built on
libsecp256k1 (the ECDH, through the `secp256k1` binding the rest of `nostr/` uses) and
`cryptography` (ChaCha20), with HMAC-SHA256 from the standard library, rather than on
nostr-sdk: the tests decrypt every sealed push with nostr-sdk's `nip44_decrypt`, which is then
an independent implementation checking this one, and both are held to the NIP's own test
vectors (tests/data/nip44_vectors.json).

One seal per push costs a key generation, an ECDH and the encryption (the bench measures it);
the device key's parse (a square root) is kept per key, since a phone gets many pushes.
`payload_length` is known before any of that, so a caller picks the plaintext that fits first
and seals once.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import os
from functools import lru_cache
from typing import Any, NamedTuple

import secp256k1
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from sigil_push.nostr.keys import is_hex

VERSION = 2
_VERSION_BYTE = bytes((VERSION,))
SALT = b"nip44-v2"
MIN_PLAINTEXT_BYTES = 1
MAX_PLAINTEXT_BYTES = 65535
_NONCE_BYTES = 32
_MAC_BYTES = 32
_OVERHEAD = 1 + _NONCE_BYTES + 2 + _MAC_BYTES
"""Version byte, nonce, the plaintext's length prefix and the MAC around the padded text."""

_ffi = secp256k1.ffi
_lib = secp256k1.lib
_context = secp256k1.secp256k1_ctx


def _copy_x(output: Any, x32: Any, _y32: Any, _data: Any) -> int:
    """libsecp256k1's ECDH hashes the shared point by default; NIP-44 takes its bare x."""
    _ffi.memmove(output, x32, 32)
    return 1


_x_coordinate = _ffi.callback(
    "int(unsigned char *, const unsigned char *, const unsigned char *, void *)", _copy_x
)


class InvalidKey(ValueError):
    """A public key that is not 64 lowercase hex naming a point on secp256k1."""


class Sealed(NamedTuple):
    """One sealed message: the NIP-44 payload and the x-only key of its one-time sender."""

    payload: str
    ephemeral_public_key: str


@lru_cache(maxsize=65536)
def _lifted(xonly_hex: str) -> Any:
    """The parsed point with x = `xonly_hex` and even y (BIP-340's lift), None if none exists."""
    if not is_hex(xonly_hex, 64):
        return None
    parsed = _ffi.new("secp256k1_pubkey *")
    if not _lib.secp256k1_ec_pubkey_parse(_context, parsed, b"\x02" + bytes.fromhex(xonly_hex), 33):
        return None
    return parsed


def is_public_key(xonly_hex: str) -> bool:
    """True for 64 lowercase hex digits that lift to a point: a key one can encrypt to."""
    return _lifted(xonly_hex) is not None


def _lifted_or_raise(xonly_hex: str) -> Any:
    point = _lifted(xonly_hex)
    if point is None:
        raise InvalidKey("not an x-only secp256k1 public key")
    return point


def _conversation(secret: bytes, point: Any) -> bytes:
    """HKDF-extract (salt 'nip44-v2') of the x coordinate of `secret` times `point`.

    `secp256k1_ecdh` (about 28 µs here) multiplies in constant time. `ec_pubkey_tweak_mul`
    plus a serialisation gives the same x in about 22 µs, but through libsecp256k1's
    variable-time `ecmult` (a tweak is public to it), which would leak the one-time secret
    through timing: not used. The Python callback that copies x costs about 0.1 µs."""
    shared = _ffi.new("unsigned char[32]")
    if not _lib.secp256k1_ecdh(_context, shared, point, secret, _x_coordinate, _ffi.NULL):
        raise ValueError("secret key out of range")
    return _mac(_SALTED, _ffi.buffer(shared)[:])


def conversation_key(secret: bytes, public_key_hex: str) -> bytes:
    """NIP-44's conversation key of a secret key and an x-only public key, as between two
    Nostr keys (what the device computes from its secret and `epk`)."""
    return _conversation(secret, _lifted_or_raise(public_key_hex))


_IPAD = int.from_bytes(b"\x36" * 64, "big")
_OPAD = int.from_bytes(b"\x5c" * 64, "big")


def _keyed(key: bytes) -> tuple[Any, Any]:
    """HMAC-SHA256's two hashes after their key block (RFC 2104; `key` of at most 64 bytes),
    to be copied for each message under the same key: HKDF-extract's key is the NIP's salt,
    so its block is set up once per process (`_SALTED`), not once per push."""
    padded = int.from_bytes(key.ljust(64, b"\0"), "big")
    return (hashlib.sha256((padded ^ _IPAD).to_bytes(64, "big")),
            hashlib.sha256((padded ^ _OPAD).to_bytes(64, "big")))


def _mac(keyed: tuple[Any, Any], message: bytes) -> bytes:
    inner, outer = keyed[0].copy(), keyed[1].copy()
    inner.update(message)
    outer.update(inner.digest())
    return bytes(outer.digest())


_SALTED = _keyed(SALT)
"""HKDF-extract's HMAC keyed with the NIP's salt, made once."""

_SHA256 = SHA256()
_MESSAGE_KEYS_BYTES = 76


def message_keys(conversation: bytes, nonce: bytes) -> tuple[bytes, bytes, bytes]:
    """(ChaCha20 key, ChaCha20 nonce, HMAC key): HKDF-expand(conversation, nonce, 76), split.

    `cryptography`'s HKDF-expand (RFC 5869) runs its three HMAC blocks in one call: about
    2.1 µs a push against 2.9 for the same blocks chained from Python."""
    keys = HKDFExpand(_SHA256, _MESSAGE_KEYS_BYTES, nonce).derive(conversation)
    return keys[:32], keys[32:44], keys[44:76]


def padded_length(length: int) -> int:
    """The NIP's `calc_padded_len`: 32 bytes at least, then steps of an eighth of the next
    power of two (of 32 bytes up to 256), so a payload's size says little about its text."""
    if length <= 32:
        return 32
    next_power = 1 << (length - 1).bit_length()
    chunk = 32 if next_power <= 256 else next_power // 8
    return chunk * ((length - 1) // chunk + 1)


def payload_length(plaintext_bytes: int) -> int:
    """Characters of the base64 payload for a plaintext of `plaintext_bytes` UTF-8 bytes, known
    before encrypting (a push's size decides which plaintext it carries)."""
    raw = _OVERHEAD + padded_length(plaintext_bytes)
    return 4 * ((raw + 2) // 3)


def encrypt(conversation: bytes, plaintext: str | bytes, nonce: bytes | None = None) -> str:
    """The base64 NIP-44 v2 payload of `plaintext` (text, or its UTF-8 bytes; `nonce`: random
    unless a test vector gives one)."""
    text = plaintext.encode() if isinstance(plaintext, str) else plaintext
    if not MIN_PLAINTEXT_BYTES <= len(text) <= MAX_PLAINTEXT_BYTES:
        raise ValueError("NIP-44 plaintexts are 1 to 65,535 bytes")
    if nonce is None:
        nonce = os.urandom(_NONCE_BYTES)
    chacha_key, chacha_nonce, hmac_key = message_keys(conversation, nonce)
    # each piece copied once (a sealed push's plaintext is ~2 KB, copied at every `+`)
    padded = b"".join(
        (len(text).to_bytes(2, "big"), text, bytes(padded_length(len(text)) - len(text)))
    )
    # cryptography's ChaCha20 takes the 32-bit block counter (0) in front of the 96-bit nonce
    encryptor = Cipher(algorithms.ChaCha20(chacha_key, bytes(4) + chacha_nonce), None).encryptor()
    authenticated = nonce + encryptor.update(padded)
    mac = hmac.digest(hmac_key, authenticated, "sha256")
    # binascii directly: base64.b64encode is a Python wrapper around the same call
    return binascii.b2a_base64(b"".join((_VERSION_BYTE, authenticated, mac)), newline=False).decode(
        "ascii"
    )


def _ephemeral_key() -> tuple[bytes, str]:
    """A fresh secret key and its x-only public key in hex.

    Each secret is 32 bytes straight from the OS's CSPRNG, independent of every other.
    `pubkey_create` itself refuses a secret of zero or not below the group order (about
    once in 2**128), so a separate `seckey_verify` would only repeat its check: a refused
    draw is simply drawn again.
    """
    point = _ffi.new("secp256k1_pubkey *")
    secret = os.urandom(32)
    while not _lib.secp256k1_ec_pubkey_create(_context, point, secret):
        secret = os.urandom(32)
    serialized = _ffi.new("unsigned char[33]")
    size = _ffi.new("size_t *", 33)
    _lib.secp256k1_ec_pubkey_serialize(
        _context, serialized, size, point, _lib.SECP256K1_EC_COMPRESSED
    )
    return secret, _ffi.buffer(serialized)[1:].hex()


def seal(device_key_hex: str, plaintext: str | bytes) -> Sealed:
    """`plaintext` encrypted to `device_key_hex` from a fresh one-time key, which the device
    decrypts with `nip44_decrypt(device_secret, ephemeral_public_key, payload)`."""
    point = _lifted_or_raise(device_key_hex)
    secret, ephemeral_public_key = _ephemeral_key()
    return Sealed(encrypt(_conversation(secret, point), plaintext), ephemeral_public_key)
