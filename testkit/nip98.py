"""NIP-98 auth headers made by an independent implementation (rust-nostr's nostr-sdk)."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import nostr_sdk


@dataclass
class SdkUser:
    """A Nostr user whose events are built and signed by nostr-sdk, not by sigil-push."""

    keys: nostr_sdk.Keys = field(default_factory=nostr_sdk.Keys.generate)

    @property
    def hex(self) -> str:
        return str(self.keys.public_key().to_hex())

    @property
    def npub(self) -> str:
        return str(self.keys.public_key().to_bech32())

    def auth_event(
        self,
        url: str,
        method: str,
        body: bytes = b"",
        created_at: int | None = None,
        kind: int = 27235,
        extra_tags: list[list[str]] | None = None,
    ) -> dict[str, Any]:
        tags = [["u", url], ["method", method]]
        if body:
            tags.append(["payload", hashlib.sha256(body).hexdigest()])
        tags.extend(extra_tags or [])
        when = int(time.time()) if created_at is None else created_at
        event = (
            nostr_sdk.EventBuilder(nostr_sdk.Kind(kind), "")
            .tags([nostr_sdk.Tag.parse(tag) for tag in tags])
            .custom_created_at(nostr_sdk.Timestamp.from_secs(when))
            .finalize(self.keys)
        )
        return dict(json.loads(event.as_json()))

    def header(self, url: str, method: str, body: bytes = b"", **kwargs: Any) -> str:
        return encode_header(self.auth_event(url, method, body, **kwargs))


def encode_header(event: dict[str, Any]) -> str:
    return "Nostr " + base64.b64encode(json.dumps(event).encode()).decode()
