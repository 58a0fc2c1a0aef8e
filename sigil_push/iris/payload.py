"""What an Iris push carries (CONTRACT 3b): `{"event", "title", "body", "icon", "url"}`.

Pure: built from the verified event (its JSON as the outbox kept it), the author's profile when
known, and `iris.notification_url`. Iris's service worker drops a push whose JSON has no
`event`, shows kind 1060 as a private message (it decrypts it itself), and otherwise shows
`title`, `body` and `icon` and opens `url` on a click.

Web Push bodies are end-to-end encrypted to the browser (RFC 8291), so they may carry the whole
event, the author's name and the start of a note; webhooks get the same JSON. APNs and FCM
targets are read by Apple and Google: they get the same keys, but `event` only where its
content is ciphertext (kinds 4, 1059, 1060), generic titles, no body, no name, no icon.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import orjson

from sigil_push.nostr.kinds import (
    DIRECT_MESSAGE,
    DOUBLE_RATCHET,
    GENERIC_REPOST,
    GIFT_WRAP,
    REACTION,
    REPOST,
    TEXT_NOTE,
    ZAP_RECEIPT,
    ZAP_REQUEST,
)
from sigil_push.nostr.nip19 import encode_note
from sigil_push.nostr.nip57 import MAX_DESCRIPTION_BYTES

WEBPUSH, WEBHOOK = "webpush", "webhook"
"""The platforms of an Iris subscription's browser and webhook targets (their `devices` rows,
payload 'iris'); its `fcm_tokens` and `apns_tokens` are rows of the providers' own platforms."""
BODY_PLATFORMS = frozenset({WEBPUSH, WEBHOOK})
"""Targets whose sender builds the body (push/iris_senders.py): the planner hands it the event
and its relay (`planned`), and the author's name is looked up at send time."""

ENCRYPTED_KINDS = frozenset({DIRECT_MESSAGE, GIFT_WRAP, DOUBLE_RATCHET})
"""Kinds whose content is ciphertext: pushed with `Urgency: high`, with an empty body, and the
only kinds whose event APNs and FCM targets carry."""
BODY_CHARACTERS = 140
MAX_NAME_CHARACTERS = 64
MAX_ICON_LENGTH = 1024
_BOLT11_AMOUNT = re.compile(r"ln(?:bcrt|bc|tbs|tb|sb)(\d{1,18})([munp]?)1", re.IGNORECASE)
_MSATS_PER_UNIT = {"": 10**11, "m": 10**8, "u": 10**5, "n": 100}
"""Millisatoshis per unit of a BOLT-11 amount (bitcoin, milli, micro, nano); pico is /10."""


def planned(event_json: str | None, relay: str) -> dict[str, str]:
    """The data of one Web Push or webhook push as planned: the event and the relay it came
    from (where its author's kind 0 is asked for)."""
    return {"event": event_json or "", "relay": relay}


class Profile(NamedTuple):
    """What an author's kind 0 says that a notification shows (each checked, or None)."""

    name: str | None
    picture: str | None


UNKNOWN_PROFILE = Profile(None, None)


def _bolt11_msats(invoice: str) -> int | None:
    match = _BOLT11_AMOUNT.match(invoice[:40])
    if match is None:
        return None
    amount, unit = int(match.group(1)), match.group(2).lower()
    return amount // 10 if unit == "p" else amount * _MSATS_PER_UNIT[unit]


def _first_tag(tags: Any, name: str) -> str | None:
    if not isinstance(tags, list):
        return None
    for tag in tags:
        if isinstance(tag, list) and len(tag) >= 2 and tag[0] == name and isinstance(tag[1], str):
            return tag[1]
    return None


def zap_request(event: dict[str, Any]) -> dict[str, Any] | None:
    """The kind 9734 a zap receipt carries in its `description` (its signature unchecked: only
    its amount and comment are read, for display to the zapped user)."""
    description = _first_tag(event.get("tags"), "description")
    if description is None or len(description) > MAX_DESCRIPTION_BYTES:
        return None
    try:
        request = orjson.loads(description)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(request, dict) or request.get("kind") != ZAP_REQUEST:
        return None
    return request


def zap_sats(event: dict[str, Any]) -> int | None:
    """A zap's amount in sats: the request's `amount` tag (msats), else the receipt's bolt11."""
    request = zap_request(event)
    amount = _first_tag(request.get("tags"), "amount") if request else None
    if amount is not None and amount.isascii() and amount.isdigit() and len(amount) <= 18:
        return int(amount) // 1000
    invoice = _first_tag(event.get("tags"), "bolt11")
    msats = _bolt11_msats(invoice) if invoice else None
    return None if msats is None else msats // 1000


def kind_title(event: dict[str, Any], generic: bool = False) -> str:
    """"Mention", "Reply", "Repost", "Reaction", "Zap of 21 sats", "DM", …; `generic`: nothing
    that describes the event beyond its kind (no amount)."""
    kind = event.get("kind")
    if kind == TEXT_NOTE:
        tags = event.get("tags")
        replying = isinstance(tags, list) and any(
            isinstance(t, list) and t[:1] == ["e"] for t in tags
        )
        return "Reply" if replying else "Mention"
    if kind in (REPOST, GENERIC_REPOST):
        return "Repost"
    if kind == REACTION:
        return "Reaction"
    if kind == ZAP_RECEIPT:
        sats = None if generic else zap_sats(event)
        return "Zap" if sats is None else f"Zap of {sats:,} sats"
    if kind in ENCRYPTED_KINDS:
        return "DM"
    return "Notification"


def _body(event: dict[str, Any]) -> str:
    kind = event.get("kind")
    if kind == TEXT_NOTE:
        content = event.get("content")
        return content[:BODY_CHARACTERS] if isinstance(content, str) else ""
    if kind == ZAP_RECEIPT:
        request = zap_request(event)
        comment = request.get("content") if request else None
        return comment[:BODY_CHARACTERS] if isinstance(comment, str) else ""
    return ""


def event_url(notification_url: str, event_id: str) -> str:
    """What a click opens: `iris.notification_url` followed by the event's `note1…` id."""
    return notification_url + encode_note(event_id)


def web_push_body(
    event: dict[str, Any], profile: Profile, notification_url: str, max_bytes: int
) -> bytes:
    """The JSON (UTF-8) a Web Push target or a webhook gets: the full event when the body fits
    `max_bytes` (a Web Push's 4,096-byte record less the encryption's overhead), else
    `{"id", "author", "kind"}`; the author's name in the title and their `https` picture as
    the icon when known (never for encrypted kinds)."""
    kind = event.get("kind")
    title = kind_title(event)
    data: dict[str, Any] = {"event": event, "title": title, "body": _body(event)}
    if kind not in ENCRYPTED_KINDS:
        if profile.name:
            data["title"] = f"{title} from {profile.name}"
        if profile.picture:
            data["icon"] = profile.picture
    data["url"] = event_url(notification_url, str(event["id"]))
    body = orjson.dumps(data)
    if len(body) > max_bytes:
        data["event"] = {"id": event["id"], "author": event["pubkey"], "kind": kind}
        body = orjson.dumps(data)
        if len(body) > max_bytes:  # a name and an icon at their bounds
            data.pop("icon", None)
            body = orjson.dumps(data)
    return body


def provider_data(event: dict[str, Any], notification_url: str) -> dict[str, str]:
    """The keys an APNs or FCM target gets, as strings (FCM data values are strings): `event`
    (its JSON) only for ciphertext kinds, a generic title, an empty body, the url; nothing
    readable about a public event's content or author. The planner drops `event` when the
    push would not fit the provider.

    A public event's `url` is `notification_url` alone: its `note1…` id would find the event
    (author, content and the keys it names, the recipient among them) on any relay, which is
    all the push withholds. A ciphertext event's url names it (the push carries it anyway)."""
    data = {"title": kind_title(event, generic=True), "body": ""}
    if event.get("kind") in ENCRYPTED_KINDS:
        data["event"] = orjson.dumps(event).decode()
        data["url"] = event_url(notification_url, str(event["id"]))
    else:
        data["url"] = notification_url
    return data


def profile_of(content: str) -> Profile:
    """A kind 0's `display_name` (else `name`) and `picture`, each bounded and printable; a
    picture only when it is an `https://` URL (Iris's worker would load it)."""
    try:
        fields = orjson.loads(content)
    except orjson.JSONDecodeError:
        return UNKNOWN_PROFILE
    if not isinstance(fields, dict):
        return UNKNOWN_PROFILE
    raw = fields.get("display_name") or fields.get("name")
    name = None
    if isinstance(raw, str):
        name = "".join(c for c in raw.strip()[:MAX_NAME_CHARACTERS] if c.isprintable()) or None
    picture = fields.get("picture")
    if not (isinstance(picture, str) and picture.startswith("https://")
            and len(picture) <= MAX_ICON_LENGTH and picture.isprintable()):
        picture = None
    return Profile(name, picture)
