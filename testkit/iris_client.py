"""A client that talks to the Iris-compatible API the way Iris's web client does.

Iris joins its notification server URL and a path by plain concatenation (`base + "subscriptions/"`),
signs NIP-98 with tags `u` and `method` only (no `payload`), content "", and sends
`Authorization: Nostr ` + `btoa(JSON)` (standard base64). Its subscriptions carry WebPush keys
in standard, padded base64. Events are signed by nostr-sdk (an independent implementation).
"""

from __future__ import annotations

import base64
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import nostr_sdk
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from testkit.nip98 import SdkUser


def iris_auth_event(user: SdkUser, url: str, method: str, created_at: int | None = None,
                    tags: list[list[str]] | None = None) -> dict[str, Any]:
    """Iris's NIP-98 event: `u` and `method` only; two in one second share an id."""
    when = int(time.time()) if created_at is None else created_at
    event = (
        nostr_sdk.EventBuilder(nostr_sdk.Kind(27235), "")
        .tags([nostr_sdk.Tag.parse(tag) for tag in [["u", url], ["method", method], *(tags or [])]])
        .custom_created_at(nostr_sdk.Timestamp.from_secs(when))
        .finalize(user.keys)
    )
    return dict(json.loads(event.as_json()))


def btoa_header(event: dict[str, Any], url_safe: bool = False) -> str:
    raw = json.dumps(event).encode()
    encoded = base64.urlsafe_b64encode(raw).rstrip(b"=") if url_safe else base64.b64encode(raw)
    return "Nostr " + encoded.decode()


@dataclass
class BrowserKeys:
    """A browser's push subscription keys (RFC 8291): the P-256 key pair and auth secret a
    browser keeps; the private half decrypts what the service sends."""

    private_key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )
    auth_secret: bytes = field(default_factory=lambda: os.urandom(16))

    @property
    def public_bytes(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )

    def subscription(self, endpoint: str) -> dict[str, str]:
        """As Iris sends it: standard, padded base64."""
        return {
            "endpoint": endpoint,
            "auth": base64.b64encode(self.auth_secret).decode(),
            "p256dh": base64.b64encode(self.public_bytes).decode(),
        }


class IrisClient:
    """Iris's calls, against `base` (the notification server URL as the user typed it, with
    its trailing slash); `public_base` is what the `u` tag names (the instance's public URL)."""

    def __init__(self, http: httpx.Client, user: SdkUser, public_base: str) -> None:
        self.http = http
        self.user = user
        self.public_base = public_base if public_base.endswith("/") else public_base + "/"

    def request(
        self, method: str, path: str, body: Any = None, created_at: int | None = None,
        header: str | None = None,
    ) -> httpx.Response:
        url = self.public_base + path
        content = b"" if body is None else json.dumps(body).encode()
        headers = {"authorization": header or btoa_header(
            iris_auth_event(self.user, url, method, created_at)
        )}
        if content:
            headers["content-type"] = "application/json"
        return self.http.request(method, "/" + path, content=content, headers=headers)

    def info(self) -> dict[str, Any]:
        response = self.http.get("/info")
        response.raise_for_status()
        return dict(response.json())

    def subscriptions(self) -> dict[str, Any]:
        response = self.request("GET", "subscriptions/")
        assert response.status_code == 200, response.text
        return dict(response.json())
