"""What a wakeup carries (CONTRACT section 4), and the fallback when the full event is too big.

The provider-neutral form is FCM's data object: `{"type": "wakeup"}` plus, by payload mode,
`event_id` and `relay`, or `event` (the event JSON as a string). APNs wraps the same extras
around a fixed, contentless alert. Nothing here ever sees the decrypted message, and nothing
but these keys is ever added.
"""

from __future__ import annotations

import json
from typing import Any

MAX_PAYLOAD_BYTES = 4096
"""APNs, FCM (data messages) and UnifiedPush (RFC 8030 distributors) all stop at 4 KiB."""

APS: dict[str, Any] = {
    "alert": {"title": "Sigil", "body": "New message"},
    "mutable-content": 1,
    "sound": "default",
}


def wakeup_data(mode: str, event_id: str, relay: str, event_json: str | None) -> dict[str, str]:
    """The data object for one event in payload mode `mode` (no fallback applied)."""
    if mode == "event" and event_json is not None:
        return {"type": "wakeup", "event": event_json}
    if mode in ("event", "event_id"):
        return {"type": "wakeup", "event_id": event_id, "relay": relay}
    return opaque_data()


def opaque_data() -> dict[str, str]:
    return {"type": "wakeup"}


def fallback(data: dict[str, str], event_id: str, relay: str) -> dict[str, str]:
    """The `event` mode's fallback: the id and relay instead of the full event."""
    if "event" not in data:
        return data
    return {"type": "wakeup", "event_id": event_id, "relay": relay}


def apns_body(data: dict[str, str]) -> dict[str, Any]:
    """The APNs JSON body: the fixed alert plus the mode's extras (never `type`)."""
    body: dict[str, Any] = {"aps": APS, **data}
    body.pop("type", None)
    return body


def compact_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def apns_size(data: dict[str, str]) -> int:
    # aioapns serialises with default separators; measure what actually goes on the wire
    return len(json.dumps(apns_body(data), ensure_ascii=False).encode())


def fcm_size(data: dict[str, str]) -> int:
    """FCM counts the keys and values of a data message against its 4 KiB."""
    return sum(len(key.encode()) + len(value.encode()) for key, value in data.items())


AES128GCM_OVERHEAD = 86 + 16 + 1
"""RFC 8188 header (salt, record size, 65-byte key id), GCM tag and padding delimiter."""


def unifiedpush_size(data: dict[str, str]) -> int:
    return len(compact_json(data)) + AES128GCM_OVERHEAD
