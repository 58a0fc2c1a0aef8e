"""NIP-44 v2 sealing (sigil_push/nostr/nip44.py) against the NIP's own test vectors, and against
nostr-sdk's independent implementation, which is what a phone's library will be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nostr_sdk
import pytest

from sigil_push.nostr import nip44
from sigil_push.nostr.keys import SecretKey

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).parents[1] / "data" / "nip44_vectors.json").read_text(encoding="utf-8")
)["v2"]


def _public(secret_hex: str) -> str:
    return SecretKey(secret_hex).public_key_hex


@pytest.mark.parametrize("vector", VECTORS["valid"]["get_conversation_key"])
def test_conversation_keys_match_the_vectors(vector: dict[str, str]) -> None:
    key = nip44.conversation_key(bytes.fromhex(vector["sec1"]), vector["pub2"])
    assert key.hex() == vector["conversation_key"]


@pytest.mark.parametrize("vector", VECTORS["invalid"]["get_conversation_key"])
def test_invalid_keys_have_no_conversation_key(vector: dict[str, str]) -> None:
    """Secret keys out of range and x coordinates with no point (or a point on the twist)."""
    with pytest.raises(ValueError):
        nip44.conversation_key(bytes.fromhex(vector["sec1"]), vector["pub2"])


def test_message_keys_match_the_vectors() -> None:
    group = VECTORS["valid"]["get_message_keys"]
    conversation = bytes.fromhex(group["conversation_key"])
    for vector in group["keys"]:
        keys = nip44.message_keys(conversation, bytes.fromhex(vector["nonce"]))
        assert keys == (
            bytes.fromhex(vector["chacha_key"]),
            bytes.fromhex(vector["chacha_nonce"]),
            bytes.fromhex(vector["hmac_key"]),
        )


def test_padded_lengths_match_the_vectors() -> None:
    for length, padded in VECTORS["valid"]["calc_padded_len"]:
        assert nip44.padded_length(length) == padded


@pytest.mark.parametrize("vector", VECTORS["valid"]["encrypt_decrypt"])
def test_encryption_matches_the_vectors(vector: dict[str, str]) -> None:
    """With the vector's nonce, the payload is the vector's, byte for byte; its length is the
    one `payload_length` predicts from the plaintext alone."""
    conversation = nip44.conversation_key(bytes.fromhex(vector["sec1"]), _public(vector["sec2"]))
    assert conversation.hex() == vector["conversation_key"]
    payload = nip44.encrypt(conversation, vector["plaintext"], bytes.fromhex(vector["nonce"]))
    assert payload == vector["payload"]
    assert len(payload) == nip44.payload_length(len(vector["plaintext"].encode()))


@pytest.mark.parametrize("length", VECTORS["invalid"]["encrypt_msg_lengths"])
def test_plaintexts_outside_the_nips_lengths_are_refused(length: int) -> None:
    with pytest.raises(ValueError):
        nip44.encrypt(bytes(32), "a" * length)


@pytest.mark.parametrize("text", ["a", "x" * 31, "x" * 33, "é" * 300, "🍕" * 1000, "y" * 65535])
def test_nostr_sdk_decrypts_a_seal_with_the_device_secret(text: str) -> None:
    """What the phone does: nip44_decrypt(device secret, epk, payload) gives the text back, and
    the payload's length is the predicted one."""
    device = SecretKey.generate()
    sealed = nip44.seal(device.public_key_hex, text)
    opened = nostr_sdk.nip44_decrypt(
        nostr_sdk.SecretKey.parse(device.secret_hex),
        nostr_sdk.PublicKey.parse(sealed.ephemeral_public_key),
        sealed.payload,
    )
    assert opened == text
    assert len(sealed.payload) == nip44.payload_length(len(text.encode()))


def test_every_seal_has_its_own_ephemeral_key_and_nonce() -> None:
    device = SecretKey.generate()
    seals = [nip44.seal(device.public_key_hex, "same text") for _ in range(20)]
    assert len({s.ephemeral_public_key for s in seals}) == 20
    assert len({s.payload for s in seals}) == 20
    assert device.public_key_hex not in {s.ephemeral_public_key for s in seals}


GROUP_ORDER = bytes.fromhex("fffffffffffffffffffffffffffffffebaaedce6af48a03bbfd25e8cd0364141")


@pytest.mark.parametrize("refused", [bytes(32), GROUP_ORDER, b"\xff" * 32])
def test_an_out_of_range_ephemeral_secret_is_drawn_again(
    refused: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zero and secrets at or above the group order are no keys: the seal draws again from
    the OS (here fed one refused draw, then a real one) and keeps the second draw."""
    good = SecretKey.generate()
    draws = iter([refused, bytes.fromhex(good.secret_hex)])
    monkeypatch.setattr(nip44.os, "urandom", lambda n: next(draws) if n == 32 else bytes(n))
    secret, public_key = nip44._ephemeral_key()
    assert (secret.hex(), public_key) == (good.secret_hex, good.public_key_hex)


@pytest.mark.parametrize(
    "key",
    [
        "ff" * 32,  # no square root, and above the field size
        "00" * 32,  # on the twist
        "1234567890abcdef1234567890abcdef1234567890abcdef1234567890abcdef",  # no square root
        "AB" * 32,  # upper case
        "ab" * 31,  # short
        "",
    ],
)
def test_keys_that_do_not_lift_are_not_public_keys(key: str) -> None:
    assert not nip44.is_public_key(key)
    with pytest.raises(nip44.InvalidKey):
        nip44.seal(key, "text")


def test_a_real_key_is_a_public_key() -> None:
    assert nip44.is_public_key(SecretKey.generate().public_key_hex)
