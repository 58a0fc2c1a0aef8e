"""Driving a real `sigil-push serve` process the way a client app and an operator would.

Pushes are counted from the dry-run sender's log lines (`dry-run wakeup … events=<id>`), which
is what a device would receive; relay state comes from `GET /health`, counters from
`GET /metrics`. Every wait polls with a generous deadline: nothing here depends on timing.
"""

from __future__ import annotations

import json
import re
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import nostr_sdk

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip98 import make_http_auth
from testkit import deadlines
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nostr_client import npub_of, secret_hex_of
from testkit.service import ServiceProcess

WAKEUP = re.compile(r"dry-run wakeup token=\S+ event_ids=([0-9a-f,]+)")
"""The dry-run sender's DEBUG line (service processes run at DEBUG); its INFO line names no
event id."""
DEADLINE_SECONDS = 60.0
"""Generous: xdist workers on a machine shared by others can stretch a live relay-list
follow past 30 s (seen at load 12); a passing wait returns as soon as its condition holds."""


def new_token() -> str:
    return "fcm-" + secrets.token_hex(16)


def _call(
    service: ServiceProcess, keys: nostr_sdk.Keys, method: str, path: str, body: dict[str, Any]
) -> httpx.Response:
    raw = json.dumps(body).encode()
    header = make_http_auth(SecretKey(secret_hex_of(keys)), service.url + path, method, raw)
    return httpx.request(
        method,
        service.url + path,
        content=raw,
        timeout=scaled(REQUEST_SECONDS),
        headers={"content-type": "application/json", "authorization": header},
    )


def register(
    service: ServiceProcess,
    keys: nostr_sdk.Keys,
    token: str,
    relays: list[str] | None = None,
    auth_signer: str | None = None,
) -> None:
    body: dict[str, Any] = {"npub": npub_of(keys), "platform": "android", "device_token": token}
    if relays is not None:
        body["relays"] = relays
    if auth_signer is not None:
        body["auth_signer"] = auth_signer
    response = _call(service, keys, "POST", "/register", body)
    assert response.status_code in (200, 201), response.text


def unregister(service: ServiceProcess, keys: nostr_sdk.Keys, token: str) -> None:
    response = _call(service, keys, "DELETE", "/unregister", {"device_token": token})
    assert response.status_code == 200, response.text


def wakeups(service: ServiceProcess) -> Counter[str]:
    """How many pushes each event id has caused so far, over every run logged in the folder."""
    counts: Counter[str] = Counter()
    for match in WAKEUP.finditer(service.log()):
        counts.update(match.group(1).split(","))
    return counts


def health(service: ServiceProcess) -> dict[str, Any]:
    return dict(httpx.get(service.admin_url + "/health", timeout=scaled(REQUEST_SECONDS)).json())


def metric(service: ServiceProcess, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(service.admin_url + "/metrics", timeout=scaled(REQUEST_SECONDS)).text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def eventually(
    condition: Callable[[], bool], what: str, timeout: float = DEADLINE_SECONDS
) -> None:
    """Polls `condition` until it holds; `timeout` is scaled (testkit.deadlines)."""
    await deadlines.eventually(condition, what, timeout, every=0.1)


async def eventually_async(
    condition: Callable[[], Awaitable[bool]], what: str, timeout: float = DEADLINE_SECONDS
) -> None:
    """Awaits `condition` until it holds; `timeout` is scaled (testkit.deadlines)."""
    await deadlines.eventually(condition, what, timeout, every=0.1)


def relay_live(service: ServiceProcess, url: str, keys: int | None = None) -> bool:
    """The relay's every REQ has reached EOSE (optionally: for exactly `keys` keys)."""
    try:
        state = health(service)["relays"].get(url)
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return bool(state and state.get("live") and (keys is None or state.get("keys") == keys))


def relay_subscribed(service: ServiceProcess, url: str) -> bool:
    """The relay is connected with at least one REQ sent (a watch REQ counts: it names no
    registered key, so `relay_live`'s keys say nothing of it)."""
    try:
        state = health(service)["relays"].get(url)
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return bool(state and state.get("connected") and state.get("subscriptions", 0) >= 1)


def seen_count(service: ServiceProcess, event_id: str) -> int:
    return sum(
        1
        for r in service.observation_records()
        if r["type"] == "seen" and r["event_id"] == event_id
    )


def assert_private(service: ServiceProcess, secrets_: list[str]) -> None:
    """No pubkey, npub, token or message text in the observation log or the service log, not
    even a 12-character piece of one (log lines truncate long values)."""
    records = "\n".join(json.dumps(r) for r in service.observation_records())
    log = service.log()
    pieces = [*secrets_, *(part for s in secrets_ if len(s) >= 24 for part in (s[:12], s[-12:]))]
    for piece in pieces:
        assert piece not in records, "a private value reached the observation log"
        assert piece not in log, "a private value reached the service log"
    for record in service.observation_records():
        assert record["type"] in ("seen", "relay", "push", "expect", "canary", "suppressed")
        allowed = {
            "seen": {"type", "ts", "relay", "event_id", "kind", "created_at"},
            "relay": {"type", "ts", "relay", "state", "detail"},
            "push": {"type", "ts", "event_id", "platform", "status", "latency_ms"},
            "expect": {"type", "ts", "event_id", "relays"},
            "suppressed": {"type", "ts", "event_id", "reason", "class"},
            "canary": {
                "type", "ts", "relay", "event_id", "published", "ok_message", "received_ms"
            },
        }[record["type"]]
        assert set(record) <= allowed, record
