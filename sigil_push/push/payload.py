"""What a wakeup carries (CONTRACT section 4), and the fallback when the full event is too big.

The provider-neutral form is FCM's data object: `{"type": "wakeup"}` plus, by payload mode,
`event_id` and `relay`, or `event` (the event JSON as a string), or `sealed` and `epk` (the
event and its relay NIP-44-encrypted to the device key). Each provider's sender wraps and
sizes it in its own module (APNs around a fixed, contentless alert). Nothing here ever sees
the decrypted message, and nothing but these keys is ever added.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache

from sigil_push.nostr import nip44

MAX_PAYLOAD_BYTES = 4096
"""APNs, FCM (data messages) and UnifiedPush (RFC 8030 distributors) all stop at 4 KiB."""


def wakeup_data(mode: str, event_id: str, relay: str, event_json: str | None) -> dict[str, str]:
    """The data object for one event in payload mode `mode` (no fallback applied)."""
    if mode == "event" and event_json is not None:
        return {"type": "wakeup", "event": event_json}
    if mode in ("event", "event_id"):
        return {"type": "wakeup", "event_id": event_id, "relay": relay}
    return opaque_data()


def opaque_data() -> dict[str, str]:
    return {"type": "wakeup"}


_EPK_PLACEHOLDER = "0" * 64


@lru_cache(maxsize=1024)
def _sealed_fits(fits: Callable[[dict[str, str]], bool], payload_length: int) -> bool:
    """Whether a sealed push whose payload has `payload_length` characters fits the provider.
    Base64 and hex need no JSON escaping, so the answer depends on the length alone, and
    NIP-44's padding leaves few lengths: asked once per (provider, length), not per push."""
    return fits({"type": "wakeup", "sealed": "A" * payload_length, "epk": _EPK_PLACEHOLDER})


@lru_cache(maxsize=1024)
def _relay_tail(text: str) -> bytes:
    """The plaintext's tail `,"relay":URL}` in UTF-8: a push's relay URL is one of a few per
    bridge, so encoded once per URL rather than once per push."""
    return (',"relay":' + json.dumps(text, ensure_ascii=False) + "}").encode()


def sealed_data(
    device_key: str,
    event_id: str,
    relay: str,
    event_json: str | None,
    fits: Callable[[dict[str, str]], bool],
) -> dict[str, str]:
    """The `sealed` data object: `{"v": 1, "event": EVENT, "relay": URL}` sealed to the device
    key from a fresh one-time key, or the pointer `{"v": 1, "id", "kind", "relay"}` when the
    push would not fit the provider (`fits`). Either way nothing about the event is in clear.

    NIP-44's payload length follows from the plaintext's, so the size is known before anything
    is encrypted, and only the plaintext that goes out is sealed (one ECDH per push). A row
    queued before its registration asked for `sealed` has no event JSON, so no kind for a
    pointer: it goes out as an opaque wakeup.
    """
    if event_json is None:
        return opaque_data()
    relay_tail = _relay_tail(relay)
    # joined, not added up: the ~2 KB event is copied once into the plaintext, not once a `+`
    plaintext = b"".join((b'{"v":1,"event":', event_json.encode(), relay_tail))
    if not _sealed_fits(fits, nip44.payload_length(len(plaintext))):
        kind = int(json.loads(event_json)["kind"])
        plaintext = b"".join(
            (b'{"v":1,"id":"', event_id.encode(), b'","kind":', str(kind).encode(), relay_tail)
        )
    sealed = nip44.seal(device_key, plaintext)
    return {"type": "wakeup", "sealed": sealed.payload, "epk": sealed.ephemeral_public_key}


def fallback(data: dict[str, str], event_id: str, relay: str) -> dict[str, str]:
    """The `event` mode's fallback: the id and relay instead of the full event."""
    if "event" not in data:
        return data
    return {"type": "wakeup", "event_id": event_id, "relay": relay}
