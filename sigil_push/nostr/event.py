"""NIP-01 events: the single validated shape in which relay and client JSON enters the code."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from sigil_push.nostr.keys import SecretKey, schnorr_verify

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


_HEX64 = re.compile(r"[0-9a-f]{64}").fullmatch
_HEX128 = re.compile(r"[0-9a-f]{128}").fullmatch
"""Exactly the lowercase hex NIP-01 allows (a compiled pattern: half the cost of a set test)."""


def _serialize_for_id(pubkey: str, created_at: int, kind: int, tags: Tags, content: str) -> bytes:
    """NIP-01's canonical form: compact, UTF-8, only `"`, `\\` and control characters escaped.

    orjson writes exactly what `json.dumps(..., separators=(",", ":"), ensure_ascii=False)`
    writes for every string Python can encode (a test holds the two equal), nine times faster;
    a string with a lone surrogate has no UTF-8 form and so no id: such an event is invalid.
    """
    try:
        return orjson.dumps([0, pubkey, created_at, kind, tags, content])
    except orjson.JSONEncodeError as exc:
        raise InvalidEvent("id_mismatch") from exc


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
        if type(raw) is not dict:
            raise InvalidEvent("not_an_object")
        get = raw.get
        event_id, pubkey, sig = get("id"), get("pubkey"), get("sig")
        created_at, kind = get("created_at"), get("kind")
        tags, content = get("tags"), get("content")
        # decoded JSON has exactly these types: `type() is` is as strict as isinstance there,
        # and stricter for a caller's subclass (a str subclass could change its own encoding)
        if type(event_id) is not str or _HEX64(event_id) is None:
            raise InvalidEvent("bad_id")
        if type(pubkey) is not str or _HEX64(pubkey) is None:
            raise InvalidEvent("bad_pubkey")
        if type(sig) is not str or _HEX128(sig) is None:
            raise InvalidEvent("bad_sig")
        if type(created_at) is not int or not 0 <= created_at <= MAX_CREATED_AT:
            raise InvalidEvent("bad_created_at")
        if type(kind) is not int or not 0 <= kind <= 65535:
            raise InvalidEvent("bad_kind")
        if type(content) is not str:
            raise InvalidEvent("bad_content")
        if type(tags) is not list:
            raise InvalidEvent("bad_tags")
        frozen = []
        for tag in tags:
            if type(tag) is not list:
                raise InvalidEvent("bad_tags")
            for item in tag:
                if type(item) is not str:
                    raise InvalidEvent("bad_tags")
            frozen.append(tuple(tag))
        return cls(event_id, pubkey, created_at, kind, tuple(frozen), content, sig)

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
