"""NIP-01 events: the single validated shape in which relay and client JSON enters the code."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sigil_push.nostr.keys import SecretKey, is_hex, schnorr_verify

Tags = tuple[tuple[str, ...], ...]
MAX_CREATED_AT = 2**53 - 1
"""JSON's largest exact integer: beyond it clients disagree on the value, and a time that large
would overflow the database's int64 arithmetic. Callers apply their own, much tighter window."""


class InvalidEvent(ValueError):
    """An event that is malformed or whose id or signature does not verify.

    `reason` is a short, fixed label (used as a metric label), never event data.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _serialize_for_id(pubkey: str, created_at: int, kind: int, tags: Tags, content: str) -> bytes:
    return json.dumps(
        [0, pubkey, created_at, kind, tags, content], separators=(",", ":"), ensure_ascii=False
    ).encode()


def compute_id(pubkey: str, created_at: int, kind: int, tags: Tags, content: str) -> str:
    """The NIP-01 event id: SHA-256 of the canonical serialisation."""
    return hashlib.sha256(_serialize_for_id(pubkey, created_at, kind, tags, content)).hexdigest()


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    pubkey: str
    created_at: int
    kind: int
    tags: Tags
    content: str
    sig: str

    @classmethod
    def from_json(cls, raw: Any) -> Event:
        """Validate the shape of a decoded JSON object; does not check id or signature."""
        if not isinstance(raw, dict):
            raise InvalidEvent("not_an_object")
        event_id, pubkey, sig = raw.get("id"), raw.get("pubkey"), raw.get("sig")
        created_at, kind = raw.get("created_at"), raw.get("kind")
        tags, content = raw.get("tags"), raw.get("content")
        if not (isinstance(event_id, str) and is_hex(event_id, 64)):
            raise InvalidEvent("bad_id")
        if not (isinstance(pubkey, str) and is_hex(pubkey, 64)):
            raise InvalidEvent("bad_pubkey")
        if not (isinstance(sig, str) and is_hex(sig, 128)):
            raise InvalidEvent("bad_sig")
        if type(created_at) is not int or not 0 <= created_at <= MAX_CREATED_AT:
            raise InvalidEvent("bad_created_at")
        if type(kind) is not int or not 0 <= kind <= 65535:
            raise InvalidEvent("bad_kind")
        if not isinstance(content, str):
            raise InvalidEvent("bad_content")
        if not isinstance(tags, list) or not all(
            isinstance(tag, list) and all(isinstance(item, str) for item in tag) for tag in tags
        ):
            raise InvalidEvent("bad_tags")
        return cls(event_id, pubkey, created_at, kind, tuple(tuple(t) for t in tags), content, sig)

    def verify(self) -> None:
        """Raise InvalidEvent unless the id matches the content and the signature is valid."""
        serialized = _serialize_for_id(self.pubkey, self.created_at, self.kind, self.tags, self.content)
        digest = hashlib.sha256(serialized).digest()
        if digest.hex() != self.id:
            raise InvalidEvent("id_mismatch")
        if not schnorr_verify(self.pubkey, digest, self.sig):
            raise InvalidEvent("bad_signature")

    def tag_values(self, name: str) -> list[str]:
        """Second elements of every tag called `name` (e.g. the `p` tags' pubkeys)."""
        return [tag[1] for tag in self.tags if len(tag) >= 2 and tag[0] == name]

    def first_tag(self, name: str) -> str | None:
        values = self.tag_values(name)
        return values[0] if values else None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pubkey": self.pubkey,
            "created_at": self.created_at,
            "kind": self.kind,
            "tags": [list(tag) for tag in self.tags],
            "content": self.content,
            "sig": self.sig,
        }


def sign_event(
    key: SecretKey,
    kind: int,
    content: str,
    tags: Sequence[Sequence[str]] = (),
    created_at: int | None = None,
) -> Event:
    """Build and sign an event with `key`."""
    frozen_tags: Tags = tuple(tuple(tag) for tag in tags)
    when = int(time.time()) if created_at is None else created_at
    event_id = compute_id(key.public_key_hex, when, kind, frozen_tags, content)
    signature = key.sign(bytes.fromhex(event_id))
    return Event(event_id, key.public_key_hex, when, kind, frozen_tags, content, signature)
