"""Turns client JSON into validated, typed requests; every refusal is a contract error code."""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cryptography.hazmat.primitives.asymmetric import ec

from sigil_push.bridge.watches import NOTIFY_CLASSES, notify_mask
from sigil_push.errors import BadRequest
from sigil_push.hosts import InvalidHost, check_host
from sigil_push.nostr.nip19 import InvalidKey, parse_public_key
from sigil_push.nostr.nip44 import is_public_key
from sigil_push.nostr.nip46 import BunkerUri, InvalidBunkerUri
from sigil_push.push import registry
from sigil_push.relays.discovery import normalize_relay_url
from sigil_push.store.records import (
    PAYLOAD_MODES,
    SENDERS,
    PreferenceChange,
    QuietHours,
    WebPushKeys,
    pack_keys,
)

MAX_USER_RELAYS = 10
MAX_BUNKER_URI_LENGTH = 2048
MAX_RELAY_URL_LENGTH = 256
BASE64URL = re.compile(r"[A-Za-z0-9_\-]+={0,2}")
WEBPUSH_AUTH_SECRET_BYTES = 16
"""RFC 8291's authentication secret."""
_UNCOMPRESSED_P256_POINT_BYTES = 65
MAX_PAUSE_SECONDS = 366 * 24 * 3600
MAX_MUTED = 1000
MAX_PRESENCE_SECONDS = 300
PREFERENCE_KEYS = ("pause_until", "senders", "muted", "notify", "quiet")
MAX_ZONE_CHARS = 64
"""IANA zone names are at most about 30 characters: a longer one is refused unread."""
_CLOCK = re.compile(r"([01][0-9]|2[0-3]):([0-5][0-9])(?::([0-5][0-9]))?")


@dataclass(frozen=True, slots=True)
class RegisterRequest:
    pubkey: str
    platform: str
    device_token: str
    payload: str
    relays: tuple[str, ...]
    webpush_keys: WebPushKeys | None
    auth_signer: BunkerUri | None
    preferences: PreferenceChange
    device_key: str | None = None


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body's JSON object. A `\\u` escape of half a surrogate pair is refused: Python
    reads it into a string that no UTF-8 encoder takes (the store's, the answer's), so it
    would fail far from here, as a 500, after the request was accepted."""
    try:
        value = json.loads(body)
        if b"\\u" in body:  # only an escape can make a lone surrogate
            json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise BadRequest("invalid_json", "body holds an unpaired UTF-16 surrogate escape") from None
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: deep nesting
        raise BadRequest("invalid_json", "body is not valid JSON") from None
    if not isinstance(value, dict):
        raise BadRequest("invalid_json", "body must be a JSON object")
    return value


def parse_npub(value: Any) -> str:
    if not isinstance(value, str):
        raise BadRequest("invalid_npub", "'npub' must be an npub1… string or 64 lowercase hex")
    try:
        return parse_public_key(value)
    except InvalidKey as exc:
        raise BadRequest("invalid_npub", f"'npub' is invalid: {exc}") from None


def parse_platform(value: Any) -> str:
    if value not in registry.PLATFORMS:
        raise BadRequest("invalid_platform", f"'platform' must be one of {', '.join(registry.PLATFORMS)}")
    return str(value)


def parse_device_token(value: Any, platform: str) -> str:
    """Syntax only, by the platform's provider; a provider's `admit` (UnifiedPush: SSRF) is run
    by the caller."""
    if not isinstance(value, str) or not value:
        raise BadRequest("invalid_device_token", "'device_token' must be a non-empty string")
    return registry.by_platform(platform).parse_token(value)


def parse_payload_mode(value: Any) -> str:
    if value is None:
        return "opaque"
    if value not in PAYLOAD_MODES:
        raise BadRequest("invalid_payload", f"'payload' must be one of {', '.join(PAYLOAD_MODES)}")
    return str(value)


def parse_relays(value: Any, allow_insecure: bool) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_USER_RELAYS:
        raise BadRequest("invalid_relays", f"'relays' must be a list of at most {MAX_USER_RELAYS} URLs")
    schemes = ("wss", "ws") if allow_insecure else ("wss",)
    relays: list[str] = []
    for item in value:
        if not isinstance(item, str) or len(item) > MAX_RELAY_URL_LENGTH:
            raise BadRequest("invalid_relays", "each relay must be a wss:// URL string")
        try:
            parts = urlsplit(item)
            parts.port  # noqa: B018 - raises ValueError on a malformed port
        except ValueError:
            raise BadRequest("invalid_relays", f"not a relay URL: {item[:80]}") from None
        if parts.scheme not in schemes or not parts.hostname or parts.username or parts.fragment:
            raise BadRequest("invalid_relays", f"relays must be {' or '.join(s + '://' for s in schemes)} URLs")
        try:
            check_host(parts.hostname, allow_private=allow_insecure)
        except InvalidHost as exc:
            raise BadRequest("invalid_relays", f"relay {exc}") from None
        normalized = normalize_relay_url(item, allow_insecure)
        if normalized is None:
            raise BadRequest("invalid_relays", f"not a relay URL: {item[:80]}")
        if normalized not in relays:
            relays.append(normalized)
    return tuple(relays)


def parse_webpush_keys(value: Any, platform: str) -> WebPushKeys | None:
    if value is None:
        return None
    valid = (
        registry.by_platform(platform).webpush_keys
        and isinstance(value, dict)
        and all(isinstance(value.get(k), str) and BASE64URL.fullmatch(value[k]) for k in ("p256dh", "auth"))
        and len(value["p256dh"]) <= 128
        and len(value["auth"]) <= 64
    )
    if not valid:
        raise BadRequest(
            "invalid_device_token",
            "'keys' must be {\"p256dh\", \"auth\"} base64url strings, for "
            f"{', '.join(p.platform for p in registry.PROVIDERS if p.webpush_keys)} only",
        )
    if not _is_p256_point(_base64url_bytes(value["p256dh"])):
        raise BadRequest(
            "invalid_device_token",
            "'keys.p256dh' must be the subscription's P-256 public key: a 65-byte uncompressed "
            "point (RFC 8291)",
        )
    if len(_base64url_bytes(value["auth"])) != WEBPUSH_AUTH_SECRET_BYTES:
        raise BadRequest("invalid_device_token", "'keys.auth' must be a 16-byte secret (RFC 8291)")
    return WebPushKeys(value["p256dh"], value["auth"])


def _base64url_bytes(text: str) -> bytes:
    """Unpadded or padded base64url (already matched by BASE64URL) as bytes; a length no
    encoder writes (one character over a group) decodes to nothing, which no check accepts."""
    unpadded = text.rstrip("=")
    try:
        return base64.urlsafe_b64decode(unpadded + "=" * (-len(unpadded) % 4))
    except binascii.Error:
        return b""


def _is_p256_point(raw: bytes) -> bool:
    """Whether `raw` is an uncompressed point on P-256. Checked at registration because a key
    that is not one makes every RFC 8291 encryption to it fail: the app would get a 201 and
    then never a push, with nothing to tell it why."""
    if len(raw) != _UNCOMPRESSED_P256_POINT_BYTES or raw[0] != 4:
        return False
    try:
        ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), raw)
    except ValueError:
        return False
    return True


def parse_device_key(value: Any) -> str | None:
    """The x-only secp256k1 public key `sealed` wakeups are encrypted to: 64 lowercase hex that
    must lift to a curve point, or no one could ever decrypt what is sealed to it."""
    if value is None:
        return None
    if not isinstance(value, str) or not is_public_key(value):
        raise BadRequest(
            "invalid_device_key",
            "'device_key' must be 64 lowercase hex: the x-only secp256k1 public key of a key"
            " pair kept on the device",
        )
    return value


def parse_auth_signer(value: Any, allow_insecure_relays: bool) -> BunkerUri | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_BUNKER_URI_LENGTH:
        raise BadRequest("invalid_auth_signer", "'auth_signer' must be a bunker:// URI")
    try:
        bunker = BunkerUri.parse(value, allow_insecure_relays)
        for relay in bunker.relays:
            check_host(urlsplit(relay).hostname or "", allow_private=allow_insecure_relays)
    except (InvalidBunkerUri, InvalidHost, ValueError) as exc:
        raise BadRequest("invalid_auth_signer", f"'auth_signer' is invalid: {exc}") from None
    return bunker


def _invalid_preferences(field: str, problem: str) -> BadRequest:
    return BadRequest("invalid_preferences", f"'{field}' {problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_preferences(body: dict[str, Any], now: int) -> PreferenceChange:
    """The preference keys present in `body` (absent ones stay as they are); every value is
    checked before anything is changed, and a refusal names its field."""
    change = PreferenceChange()
    if "pause_until" in body:
        value = body["pause_until"]
        if value is not None and not _is_int(value):
            raise _invalid_preferences("pause_until", "must be Unix seconds or null")
        if value is not None and value > now + MAX_PAUSE_SECONDS:
            raise _invalid_preferences("pause_until", "may be at most 366 days ahead")
        # null or a time already past clears the pause
        until = value if value is not None and value > now else None
        change = PreferenceChange(sets_pause=True, pause_until=until)
    senders = body.get("senders")
    if "senders" in body and senders not in SENDERS:
        raise _invalid_preferences("senders", f"must be one of {', '.join(SENDERS)}")
    muted: bytes | None = None
    muted_count = 0
    if "muted" in body:
        value = body["muted"]
        if not isinstance(value, list) or len(value) > MAX_MUTED:
            raise _invalid_preferences("muted", f"must be a list of at most {MAX_MUTED} pubkeys")
        keys = []
        for item in value:
            if not isinstance(item, str) or len(item) > 100:
                raise _invalid_preferences("muted", "entries must be 64 hex or npub strings")
            try:
                keys.append(parse_public_key(item.lower() if len(item) == 64 else item))
            except InvalidKey:
                raise _invalid_preferences(
                    "muted", f"entry is neither 64 hex nor an npub: {item[:70]}"
                ) from None
        muted = pack_keys(keys)
        muted_count = len(muted) // 32
    return PreferenceChange(
        change.sets_pause, change.pause_until, senders if "senders" in body else None,
        muted, muted_count,
        _parse_notify(body["notify"]) if "notify" in body else None,
        "quiet" in body, _parse_quiet(body["quiet"]) if "quiet" in body else None,
    )


def _parse_notify(value: Any) -> int:
    """`notify`: a non-empty list of notification classes, as their bit mask."""
    if (not isinstance(value, list) or not value or len(value) > len(NOTIFY_CLASSES)
            or not all(isinstance(item, str) and item in NOTIFY_CLASSES for item in value)):
        raise _invalid_preferences(
            "notify", f"must be a non-empty list of {', '.join(NOTIFY_CLASSES)}"
        )
    return notify_mask(value)


def _clock(field: str, value: Any) -> int:
    if not isinstance(value, str) or len(value) > 8 or (found := _CLOCK.fullmatch(value)) is None:
        raise _invalid_preferences(field, 'must be a time of day, "HH:MM"')
    hour, minute, second = found.groups()
    return int(hour) * 3600 + int(minute) * 60 + int(second or 0)


def _parse_quiet(value: Any) -> QuietHours | None:
    """`quiet`: null, or {"from": "HH:MM", "to": "HH:MM", "tz": IANA zone} (seconds may be
    given too, "HH:MM:SS"); the window may cross midnight, `from` == `to` is refused."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"from", "to", "tz"}:
        raise _invalid_preferences("quiet", 'must be null or {"from", "to", "tz"}')
    start, end = _clock("quiet.from", value["from"]), _clock("quiet.to", value["to"])
    if start == end:
        raise _invalid_preferences("quiet", "'from' and 'to' must differ")
    zone = value["tz"]
    if not isinstance(zone, str) or not zone or len(zone) > MAX_ZONE_CHARS:
        raise _invalid_preferences("quiet.tz", "must be an IANA time zone name")
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise _invalid_preferences("quiet.tz", "is not a known IANA time zone") from None
    return QuietHours(start, end, zone)


def parse_presence_seconds(value: Any) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_PRESENCE_SECONDS:
        raise _invalid_preferences("seconds", f"must be an integer from 0 to {MAX_PRESENCE_SECONDS}")
    return int(value)


def parse_pair_token(value: Any) -> str:
    """The `device_token` naming one of the caller's pairs (its syntax is the platform's,
    checked when it was registered)."""
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise BadRequest("invalid_device_token", "'device_token' must be a non-empty string")
    return value


def parse_register(
    body: dict[str, Any], pubkey: str, allow_insecure_relays: bool, now: int | None = None
) -> RegisterRequest:
    """The rest of a registration, once the caller has checked `npub` against the auth key."""
    platform = parse_platform(body.get("platform"))
    payload = parse_payload_mode(body.get("payload"))
    device_key = parse_device_key(body.get("device_key"))
    if payload == "sealed" and device_key is None:
        raise BadRequest("invalid_payload", "'payload': 'sealed' needs a 'device_key' to seal to")
    return RegisterRequest(
        pubkey=pubkey,
        platform=platform,
        device_token=parse_device_token(body.get("device_token"), platform),
        payload=payload,
        relays=parse_relays(body.get("relays"), allow_insecure_relays),
        webpush_keys=parse_webpush_keys(body.get("keys"), platform),
        auth_signer=parse_auth_signer(body.get("auth_signer"), allow_insecure_relays),
        preferences=parse_preferences(body, int(time.time()) if now is None else now),
        device_key=device_key,
    )
