"""Senders for the targets of Iris subscriptions: browser Web Push endpoints and webhooks.

Both use the UnifiedPush sender's machinery (push/unifiedpush_sender.py): an HTTP session
resolving through `PublicResolver` (no internal address, no redirect) and its outcome mapping,
so a dead endpoint (404, 410) is `unregistered` and its device forgotten, which removes it from
every subscription (migration 0018's trigger deletes a subscription left without targets).
What differs is the body, built here at send time from the planned event (`payload.planned`)
with the author's name looked up within a second (iris/profiles.py):

- Web Push (`webpush`): RFC 8291 `aes128gcm` of the Iris JSON (iris/payload.py) with VAPID
  (UnifiedPush's key and `sub`), `TTL`, `Urgency` (high for kinds 4, 1059, 1060; normal
  otherwise) and a `Topic` per event, so a push service keeps one copy of a resend.
- Webhook (`webhook`): an HTTPS POST of the same JSON (the URL is the user's own).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

import orjson
from pywebpush import WebPusher, WebPushException

from sigil_push.iris.payload import (
    ENCRYPTED_KINDS,
    UNKNOWN_PROFILE,
    WEBHOOK,
    WEBPUSH,
    web_push_body,
)
from sigil_push.iris.profiles import Profiles
from sigil_push.push.base import Outcome, Status, WakeupMessage
from sigil_push.push.endpoint_guard import UnsafeEndpoint, parse_endpoint
from sigil_push.push.payload import MAX_PAYLOAD_BYTES
from sigil_push.push.registry import IRIS_POLICY
from sigil_push.push.unifiedpush_sender import AES128GCM_OVERHEAD, GuardedPoster
from sigil_push.push.vapid import VapidSigner
from sigil_push.store.records import Device

MAX_BODY_BYTES = MAX_PAYLOAD_BYTES - AES128GCM_OVERHEAD
"""The Iris JSON's most bytes: a Web Push record is at most 4,096 bytes once encrypted (a
webhook gets the same JSON, so the same rule)."""


checked_endpoint = lru_cache(maxsize=16_384)(parse_endpoint)
"""`parse_endpoint` remembered per (URL, allow_private): a target's URL is checked on every
push, and parsing it (the URL, the host's form, a literal address) was a twentieth of a Web
Push's CPU. Pure, so a remembered answer is the answer; a refusal raises and is not kept."""


def topic(event_id: str) -> str:
    """RFC 8030 `Topic` (at most 32 URL-safe base64 characters): one per event, so a push
    service replaces an undelivered copy of the same event rather than keeping both."""
    return hashlib.sha256(event_id.encode()).hexdigest()[:32]


class IrisBodies:
    """Builds an Iris push's JSON from a planned message; None: nothing to send."""

    def __init__(self, notification_url: str, profiles: Profiles | None) -> None:
        self._url = notification_url
        self._profiles = profiles

    async def build(self, message: WakeupMessage) -> tuple[bytes, int, str] | None:
        """(the JSON, the event's kind, its id), or None for a message without an event."""
        raw = message.data.get("event")
        if not raw:
            return None
        event: dict[str, Any] = orjson.loads(raw)
        kind = int(event["kind"])
        profile = UNKNOWN_PROFILE
        if self._profiles is not None and kind not in ENCRYPTED_KINDS:
            profile = await self._profiles.lookup(str(event["pubkey"]), message.data.get("relay", ""))
        return web_push_body(event, profile, self._url, MAX_BODY_BYTES), kind, str(event["id"])

    async def close(self) -> None:
        if self._profiles is not None:
            await self._profiles.close()


class IrisWebPushSender(GuardedPoster):
    """Web Push to a browser's endpoint, encrypted to its subscription's keys."""

    platform = WEBPUSH
    provider = WEBPUSH
    max_concurrency = IRIS_POLICY.max_concurrency

    def __init__(
        self, allow_private: bool, timeout_seconds: float, vapid: VapidSigner, bodies: IrisBodies
    ) -> None:
        super().__init__(allow_private, timeout_seconds)
        self.vapid = vapid
        self._bodies = bodies

    def fits(self, data: dict[str, str]) -> bool:
        return True  # the body is fitted to the record when it is built

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        keys = device.webpush_keys
        if keys is None:
            return Outcome(Status.REJECTED, detail="invalid webpush keys")
        try:
            checked_endpoint(device.token, self._allow_private)
            pusher = WebPusher({"endpoint": device.token, "keys": {"p256dh": keys.p256dh, "auth": keys.auth}})
        except UnsafeEndpoint:
            return Outcome(Status.REJECTED, detail="unsafe endpoint")
        except (WebPushException, ValueError):
            return Outcome(Status.REJECTED, detail="invalid webpush keys")
        built = await self._bodies.build(message)
        if built is None:
            return Outcome(Status.REJECTED, detail="no event to show")
        body, kind, event_id = built
        headers = {
            "TTL": str(message.ttl_seconds),
            "Urgency": "high" if kind in ENCRYPTED_KINDS else "normal",
            "Topic": topic(event_id),
            "Authorization": self.vapid.authorization(device.token),
            "Content-Type": "application/octet-stream",
            "Content-Encoding": "aes128gcm",
        }
        encrypted = bytes(pusher.encode(body, "aes128gcm")["body"])
        return await self._post(device.token, encrypted, headers)

    async def close(self) -> None:
        await super().close()
        await self._bodies.close()


class WebhookSender(GuardedPoster):
    """An HTTPS POST of the Iris JSON to a subscription's webhook URL."""

    platform = WEBHOOK
    provider = WEBHOOK
    max_concurrency = IRIS_POLICY.max_concurrency

    def __init__(self, allow_private: bool, timeout_seconds: float, bodies: IrisBodies) -> None:
        super().__init__(allow_private, timeout_seconds)
        self._bodies = bodies

    def fits(self, data: dict[str, str]) -> bool:
        return True

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        try:
            checked_endpoint(device.token, self._allow_private)
        except UnsafeEndpoint:
            return Outcome(Status.REJECTED, detail="unsafe endpoint")
        built = await self._bodies.build(message)
        if built is None:
            return Outcome(Status.REJECTED, detail="no event to show")
        return await self._post(device.token, built[0], {"Content-Type": "application/json"})

    async def close(self) -> None:
        await super().close()
        await self._bodies.close()
