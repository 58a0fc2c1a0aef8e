"""An Iris subscription (CONTRACT 3b) as a client sends it, checked into a typed value.

Shape and size are checked here, before anything costs I/O: filters (each must name `#p` or
`authors`, what the bridge can index and ask relays for), lists, targets and their WebPush keys.
Where a target leads (its host resolving to a public address) is the API's to check, as for
UnifiedPush registrations. The document is kept as received (only the keys of a Subscription):
Iris finds its own subscriptions by reading them back, so GET must return them unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sigil_push.errors import BadRequest
from sigil_push.http.validation import parse_webpush_keys
from sigil_push.iris.payload import WEBHOOK, WEBPUSH
from sigil_push.push import registry
from sigil_push.push.endpoint_guard import UnsafeEndpoint, parse_endpoint
from sigil_push.store.records import WebPushKeys

MAX_SUBSCRIPTIONS_PER_PUBKEY = 20
MAX_FILTERS = 10
MAX_VALUES = 1000
MAX_TARGETS = 10
MAX_BODY_BYTES = 64 * 1024
MAX_TAG_VALUE_LENGTH = 1024
MAX_KIND = 65535

DOCUMENT_KEYS = (
    "filter", "filters", "web_push_subscriptions", "webhooks", "fcm_tokens", "apns_tokens",
    "social_graph_filter",
)
"""What is stored and shown back; `subscriber` (Iris copies it from a GET) and anything else
is dropped."""
IGNORED_FILTER_KEYS = frozenset({"since", "until", "limit"})
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TAG_KEY = re.compile(r"#[A-Za-z]")
_UUID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_-]{0,63}")
"""A subscription id as a URL path segment: NNS makes UUIDs; POST /subscriptions/{id} creates an
unknown id as given, so anything URL-safe of reasonable length is taken."""

APNS, FCM = "ios", "android"  # with WEBPUSH and WEBHOOK (iris.payload)
"""The platform of each kind of target (its row in `devices`, payload 'iris')."""


@dataclass(frozen=True, slots=True)
class Filter:
    """A NIP-01 filter: each field None when absent (absent matches anything)."""

    ids: frozenset[str] | None
    authors: frozenset[str] | None
    kinds: frozenset[int] | None
    tags: tuple[tuple[str, frozenset[str]], ...]
    """(letter, values) of each `#x` key."""

    @property
    def p_tags(self) -> frozenset[str] | None:
        return next((values for letter, values in self.tags if letter == "p"), None)


@dataclass(frozen=True, slots=True)
class Target:
    """One push target: its platform, its token as stored (endpoint, URL or provider token)."""

    platform: str
    token: str
    keys: WebPushKeys | None = None


@dataclass(frozen=True, slots=True)
class Subscription:
    document: dict[str, Any]
    filters: tuple[Filter, ...]
    targets: tuple[Target, ...]
    social_graph_filter: bool


def invalid_filter(message: str) -> BadRequest:
    return BadRequest("invalid_filter", message)


def check_subscription_id(value: str) -> str:
    if not _UUID.fullmatch(value):
        raise BadRequest("invalid_filter", "a subscription id is 1 to 64 letters, digits, - or _")
    return value


def _string_list(value: Any, name: str, pattern: re.Pattern[str] | None) -> frozenset[str]:
    if not isinstance(value, list):
        raise invalid_filter(f"'{name}' must be a list")
    if len(value) > MAX_VALUES:
        raise invalid_filter(f"'{name}' may hold at most {MAX_VALUES} values")
    for item in value:
        if not isinstance(item, str) or len(item) > MAX_TAG_VALUE_LENGTH:
            raise invalid_filter(f"'{name}' must hold strings")
        if pattern is not None and not pattern.fullmatch(item):
            raise invalid_filter(f"'{name}' must hold 64-character lowercase hex values")
    return frozenset(value)


def parse_filter(value: Any) -> Filter:
    """One NIP-01 filter; it must name `#p` or `authors` (with at least one value)."""
    if not isinstance(value, dict):
        raise invalid_filter("a filter must be a JSON object")
    ids = authors = None
    kinds: frozenset[int] | None = None
    tags: list[tuple[str, frozenset[str]]] = []
    for key, item in value.items():
        if key in IGNORED_FILTER_KEYS:
            continue
        if key == "ids":
            ids = _string_list(item, key, _HEX64)
        elif key == "authors":
            authors = _string_list(item, key, _HEX64)
        elif key == "kinds":
            if not isinstance(item, list) or len(item) > MAX_VALUES:
                raise invalid_filter(f"'kinds' must be a list of at most {MAX_VALUES} kinds")
            if not all(type(k) is int and 0 <= k <= MAX_KIND for k in item):
                raise invalid_filter("'kinds' must hold integers from 0 to 65535")
            kinds = frozenset(item)
        elif isinstance(key, str) and _TAG_KEY.fullmatch(key):
            tags.append((key[1], _string_list(item, key, _HEX64 if key in ("#p", "#e") else None)))
        else:
            raise invalid_filter(f"unknown filter key {str(key)[:20]!r}")
    parsed = Filter(ids, authors, kinds, tuple(sorted(tags)))
    if not parsed.authors and not parsed.p_tags:
        raise invalid_filter("each filter must name '#p' or 'authors'")
    return parsed


def _list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest("invalid_device_token", f"'{key}' must be a list")
    return value


def _standard_to_url_safe(text: str) -> str:
    """Iris sends RFC 8291 keys in standard base64 (`btoa`); stored and sent as base64url."""
    return text.replace("+", "-").replace("/", "_")


def _web_push(item: Any, allow_private: bool) -> Target:
    if not isinstance(item, dict) or not isinstance(item.get("endpoint"), str):
        raise BadRequest(
            "invalid_device_token",
            "'web_push_subscriptions' holds {\"endpoint\", \"auth\", \"p256dh\"} objects",
        )
    endpoint = item["endpoint"]
    try:
        parse_endpoint(endpoint, allow_private)
    except UnsafeEndpoint as exc:
        raise BadRequest("invalid_device_token", str(exc)) from None
    raw_keys = {
        name: _standard_to_url_safe(key) if isinstance(key := item.get(name), str) else key
        for name in ("p256dh", "auth")
    }
    keys = parse_webpush_keys(raw_keys, "unifiedpush")
    return Target(WEBPUSH, endpoint, keys)


def _webhook(item: Any, allow_private: bool) -> Target:
    if not isinstance(item, str):
        raise BadRequest("invalid_device_token", "'webhooks' holds https:// URLs")
    try:
        parse_endpoint(item, allow_private)
    except UnsafeEndpoint as exc:
        raise BadRequest("invalid_device_token", str(exc).replace("endpoint", "webhook")) from None
    return Target(WEBHOOK, item)


def _provider_token(item: Any, platform: str) -> Target:
    if not isinstance(item, str):
        raise BadRequest("invalid_device_token", "tokens must be strings")
    return Target(platform, registry.by_platform(platform).parse_token(item))


@dataclass(frozen=True, slots=True)
class Accepted:
    """What this instance takes as targets. `platforms`: `webpush` (with UnifiedPush's VAPID
    identity), `ios`, `android` as configured, others `400 platform_disabled`; `webhooks`:
    with `[webhooks]` enabled. `private_*`: loopback and plain-http endpoints (tests only,
    `unifiedpush.allow_private_endpoints`, `webhooks.allow_private_endpoints`)."""

    platforms: frozenset[str]
    webhooks: bool
    private_push: bool = False
    private_webhooks: bool = False


def parse_subscription(body: dict[str, Any], accepted: Accepted) -> Subscription:
    """The subscription in `body`, its targets checked against what is `accepted`."""
    if "filter" not in body:
        raise invalid_filter("'filter' is required")
    filters = [body["filter"]]
    extra = body.get("filters")
    if extra is not None:
        if not isinstance(extra, list):
            raise invalid_filter("'filters' must be a list of filters")
        filters.extend(extra)
    if len(filters) > MAX_FILTERS:
        raise invalid_filter(f"a subscription may hold at most {MAX_FILTERS} filters")
    parsed_filters = tuple(parse_filter(item) for item in filters)

    social = body.get("social_graph_filter", False)
    if social is None:
        social = False
    if not isinstance(social, bool):
        raise invalid_filter("'social_graph_filter' must be true or false")

    sources = {
        WEBPUSH: _list(body, "web_push_subscriptions"), WEBHOOK: _list(body, "webhooks"),
        FCM: _list(body, "fcm_tokens"), APNS: _list(body, "apns_tokens"),
    }
    if sum(len(items) for items in sources.values()) > MAX_TARGETS:
        raise invalid_filter(f"a subscription may hold at most {MAX_TARGETS} push targets")
    for platform, items in sources.items():
        if not items:
            continue
        if platform == WEBHOOK and not accepted.webhooks:
            raise BadRequest("platform_disabled", "this instance does not send webhooks")
        if platform != WEBHOOK and platform not in accepted.platforms:
            raise BadRequest("platform_disabled", f"this instance does not send to {platform}")
    targets: list[Target] = []
    targets.extend(_web_push(item, accepted.private_push) for item in sources[WEBPUSH])
    targets.extend(_webhook(item, accepted.private_webhooks) for item in sources[WEBHOOK])
    targets.extend(_provider_token(item, FCM) for item in sources[FCM])
    targets.extend(_provider_token(item, APNS) for item in sources[APNS])
    if not targets:
        raise BadRequest("invalid_device_token", "a subscription needs at least one push target")
    unique = tuple({(t.platform, t.token): t for t in targets}.values())
    document = {key: body[key] for key in DOCUMENT_KEYS if key in body}
    return Subscription(document, parsed_filters, unique, social)
