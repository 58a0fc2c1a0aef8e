"""NIP-98 HTTP Auth: proves a request was made by the holder of a Nostr key.

This module checks everything that depends only on the request itself. Replay (single use of an
auth event) needs shared state and is enforced by the store (sigil_push/store/auth_ids.py).

Iris, the one app that lets its user pick a notification server, signs as nostr-notification-
server expects: no `payload` tag, and `btoa` (standard base64) or a url-safe flavour. The routes
of its API (CONTRACT 3b) verify with `lenient=True`: a missing `payload` tag is accepted there
(one present is checked), and so is either base64 alphabet, padded or not.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence

from sigil_push.nostr.event import Event, InvalidEvent, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.kinds import HTTP_AUTH

MAX_CLOCK_SKEW_SECONDS = 60
SCHEME = "Nostr"


class AuthError(Exception):
    """Base of the NIP-98 failures; `detail` says which check failed (safe to show the caller)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class AuthMissing(AuthError):
    pass


class AuthInvalid(AuthError):
    pass


class AuthExpired(AuthError):
    pass


def _decode_token(token: str, lenient: bool) -> bytes:
    """The token's bytes: strict standard base64, or (lenient) either alphabet, padded or not."""
    if not lenient:
        return base64.b64decode(token, validate=True)
    padded = token + "=" * (-len(token) % 4)
    if "-" in token or "_" in token:
        return base64.urlsafe_b64decode(padded.encode("ascii"))
    return base64.b64decode(padded, validate=True)


def verify_http_auth(
    header: str | None, url: str, method: str, body: bytes, now: float, lenient: bool = False
) -> Event:
    """Return the verified auth event for this request or raise the matching AuthError.

    `url` is the absolute URL the client must have signed (public_url + path), compared exactly.
    A request without a body must not carry a `payload` tag bound to other content; a request
    with a body must carry the hash of exactly that body (`lenient`: or no `payload` tag).
    """
    if not header:
        raise AuthMissing("Authorization header with scheme 'Nostr' is required")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != SCHEME.lower() or not token.strip():
        raise AuthMissing("Authorization header with scheme 'Nostr' is required")
    try:
        decoded = json.loads(_decode_token(token.strip(), lenient))
    except (binascii.Error, ValueError, RecursionError):  # RecursionError: deep nesting
        raise AuthInvalid("token is not base64-encoded JSON") from None
    try:
        event = Event.from_json(decoded)
    except InvalidEvent as exc:
        raise AuthInvalid(f"token is not a Nostr event ({exc.reason})") from None
    if event.kind != HTTP_AUTH:
        raise AuthInvalid(f"auth event must be kind {HTTP_AUTH}")
    try:
        event.verify()
    except InvalidEvent as exc:
        raise AuthInvalid(f"auth event {exc.reason.replace('_', ' ')}") from None
    if event.first_tag("u") != url:
        raise AuthInvalid(f"'u' tag must be exactly {url}")
    if (event.first_tag("method") or "").upper() != method.upper():
        raise AuthInvalid(f"'method' tag must be {method.upper()}")
    payload_tag = event.first_tag("payload")
    if body and not (lenient and payload_tag is None):
        if payload_tag != hashlib.sha256(body).hexdigest():
            raise AuthInvalid("'payload' tag must be the hex SHA-256 of the request body")
    elif payload_tag is not None and payload_tag != hashlib.sha256(b"").hexdigest():
        raise AuthInvalid("'payload' tag given for a request without a body")
    if abs(now - event.created_at) > MAX_CLOCK_SKEW_SECONDS:
        raise AuthExpired(f"auth event must be created within {MAX_CLOCK_SKEW_SECONDS} s of now")
    return event


def make_http_auth(
    key: SecretKey, url: str, method: str, body: bytes = b"", created_at: int | None = None
) -> str:
    """Build an `Authorization` header value (used by benchmarks and clients written in Python)."""
    tags: list[Sequence[str]] = [["u", url], ["method", method.upper()]]
    if body:
        tags.append(["payload", hashlib.sha256(body).hexdigest()])
    event = sign_event(key, HTTP_AUTH, "", tags, created_at)
    encoded = base64.b64encode(json.dumps(event.to_json(), separators=(",", ":")).encode())
    return f"{SCHEME} {encoded.decode()}"
