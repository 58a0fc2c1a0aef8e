"""Encryption at rest for secrets the bridge must keep (NIP-46 session secrets and keys).

AES-256-GCM under a key derived (HKDF-SHA256) from the bridge's own secret key, so a copy of
the database alone reveals nothing. Changing `server.secret_key` makes old sealed values
unreadable on purpose: users then re-register their signer.
"""

from __future__ import annotations

import base64
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sigil_push.nostr.keys import SecretKey

VERSION = "v1"
NONCE_BYTES = 12


class UnreadableSecret(Exception):
    """A sealed value that was tampered with or sealed under another bridge key."""


class Sealer:
    def __init__(self, bridge_key: SecretKey, purpose: str) -> None:
        derived = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None,
            info=f"sigil-push {purpose} {VERSION}".encode(),
        ).derive(bytes.fromhex(bridge_key.secret_hex))
        self._aead = AESGCM(derived)
        self._purpose = purpose.encode()

    def seal(self, plaintext: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, plaintext.encode(), self._purpose)
        return f"{VERSION}:{base64.b64encode(nonce + sealed).decode()}"

    def open(self, sealed: str) -> str:
        version, _, body = sealed.partition(":")
        if version != VERSION:
            raise UnreadableSecret(f"unknown sealing version {version!r}")
        try:
            raw = base64.b64decode(body, validate=True)
            return self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], self._purpose).decode()
        except (ValueError, InvalidTag) as exc:
            raise UnreadableSecret("sealed value cannot be opened with this bridge key") from exc
