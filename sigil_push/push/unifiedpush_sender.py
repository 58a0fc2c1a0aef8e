"""UnifiedPush per AND_3: an RFC 8030 POST to the device's endpoint, RFC 8291-encrypted with
pywebpush and identified with VAPID (RFC 8292, sigil_push/push/vapid.py).

Every POST carries `TTL` (autopush refuses a push without it), `Urgency: high` (each wakeup is
a DM) and the VAPID `Authorization`; opaque wakeups share a `Topic`, so a distributor keeps only
the latest for an offline phone. The encrypted body stays within AND_3's 4,096 bytes: `fits`
measures it, and the delivery loop falls back from `event` to `event_id` when it would not.

The endpoint is user input, so the HTTP session resolves names through `PublicResolver` (no
loopback, private or otherwise internal address, checked on every connection, not just at
registration) and never follows a redirect. Registrations from before AND_3 carry no WebPush
keys; their body is the plain JSON wakeup, which is contentless by construction in the opaque
and event_id modes.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from pywebpush import WebPusher, WebPushException

from sigil_push.push.base import Outcome, Status, WakeupMessage, parse_retry_after
from sigil_push.push.endpoint_guard import (
    PublicResolver,
    UnsafeEndpoint,
    UnsafeResolution,
    parse_endpoint,
)
from sigil_push.push.provider import Provider
from sigil_push.push.vapid import VapidSigner
from sigil_push.store.records import Device


def compact_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


AES128GCM_OVERHEAD = 86 + 16 + 1
"""RFC 8188 header (salt, record size, 65-byte key id), GCM tag and padding delimiter."""


def unifiedpush_size(data: dict[str, str]) -> int:
    return len(compact_json(data)) + AES128GCM_OVERHEAD


OPAQUE_TOPIC = "wakeup"
"""RFC 8030 Topic: a distributor keeps only the latest opaque wakeup for an offline device."""


def _outcome(status: int, retry_after: str | None) -> Outcome:
    if status in (200, 201, 202):
        return Outcome(Status.ACCEPTED)
    if status in (404, 410):
        return Outcome(Status.UNREGISTERED, detail=f"http {status}")
    if status == 429 or status >= 500:
        return Outcome(Status.RETRY, parse_retry_after(retry_after), f"http {status}")
    if 300 <= status < 400:
        return Outcome(Status.REJECTED, detail=f"http {status}: redirects are not followed")
    if status in (401, 403):
        return Outcome(Status.REJECTED, detail=f"http {status}: the distributor refused our VAPID")
    return Outcome(Status.REJECTED, detail=f"http {status}")


class GuardedPoster:
    """POSTs to user-chosen URLs: names resolved through `PublicResolver` (no internal
    address, checked on every connection), no redirect followed, the answer mapped to an
    Outcome (404 and 410: the endpoint is gone). Shared by UnifiedPush and the Iris targets'
    senders (push/iris_senders.py)."""

    def __init__(self, allow_private: bool, timeout_seconds: float) -> None:
        self._allow_private = allow_private
        connector = aiohttp.TCPConnector(resolver=None if allow_private else PublicResolver())
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=timeout_seconds),
            trust_env=False,
        )

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> Outcome:
        try:
            async with self._session.post(
                url, data=body, headers=headers, allow_redirects=False
            ) as response:
                return _outcome(response.status, response.headers.get("Retry-After"))
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, UnsafeResolution):
                return Outcome(Status.REJECTED, detail="unsafe endpoint")
            return Outcome(Status.RETRY, detail="connection failed")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return Outcome(Status.RETRY, detail="connection failed")

    async def close(self) -> None:
        await self._session.close()


class UnifiedPushSender(GuardedPoster):

    def __init__(
        self,
        allow_private: bool,
        timeout_seconds: float,
        vapid: VapidSigner,
        declared: Provider[Any],
    ) -> None:
        """`declared`: the provider's declaration, whose name, platform and limits the sender
        takes (handed over, so the sender imports nothing back)."""
        super().__init__(allow_private, timeout_seconds)
        self.platform = declared.platform
        self.provider = declared.name
        self.max_concurrency = declared.policy.max_concurrency
        self._max_payload = declared.policy.max_payload_bytes
        self.vapid = vapid

    def fits(self, data: dict[str, str]) -> bool:
        return unifiedpush_size(data) <= self._max_payload

    def _request(self, message: WakeupMessage, device: Device) -> tuple[bytes, dict[str, str]]:
        body = compact_json(message.data)
        headers = {
            "TTL": str(message.ttl_seconds),
            "Urgency": "high",
            "Authorization": self.vapid.authorization(device.token),
        }
        if message.opaque:
            headers["Topic"] = OPAQUE_TOPIC
        keys = device.webpush_keys
        if keys is None:
            headers["Content-Type"] = "application/json"
            return body, headers
        pusher = WebPusher({"endpoint": device.token, "keys": {"p256dh": keys.p256dh, "auth": keys.auth}})
        headers["Content-Type"] = "application/octet-stream"
        headers["Content-Encoding"] = "aes128gcm"
        return bytes(pusher.encode(body, "aes128gcm")["body"]), headers

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        try:
            parse_endpoint(device.token, self._allow_private)
            body, headers = self._request(message, device)
        except UnsafeEndpoint:
            return Outcome(Status.REJECTED, detail="unsafe endpoint")
        except (WebPushException, ValueError):
            return Outcome(Status.REJECTED, detail="invalid webpush keys")
        return await self._post(device.token, body, headers)
