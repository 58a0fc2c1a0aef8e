"""Iris, end to end (issue 33): a client doing exactly what Iris's web client does, in its order,
against a real `sigil-push serve` process and a real `nostr-relay`, with a loopback stand-in
for the browser's Web Push service.

The client: `GET info` (the VAPID key it hands the browser), `GET subscriptions/` (trailing
slash), then its two subscriptions on one browser endpoint posted together in the same second
(`btoa` NIP-98 without `payload`: the same auth event id, two signatures), a kind 1060 by its
double-ratchet session key, a key rotation (`GET subscriptions/`, then `POST
subscriptions/{id}` with the new key and the `subscriber` copied from the GET) and a deletion.

The push service (testkit.fakes.fake_unifiedpush, autopush's rules) accepts a push only with a
VAPID header whose JWT verifies, whose `aud` is its origin, `exp` within 24 h and `sub` set,
and whose `k` is the key `/info` gave (the endpoint is bound to it, as a browser binds its
subscription to the `applicationServerKey`); every accepted message is decrypted with the
subscription's private key, as the browser would.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import http_ece
import httpx
import nostr_sdk
import pytest

from testkit.bridge_harness import assert_private, eventually, relay_subscribed
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush, PushRequest, parse_vapid
from testkit.iris_client import BrowserKeys, IrisClient
from testkit.nip98 import SdkUser
from testkit.nostr_client import hex_of, publish, signed_event
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess

pytestmark = pytest.mark.slow  # starts its own processes

SUBJECT = "mailto:ops@example.org"
NOTIFICATION_URL = "https://iris.example/"
IRIS_TOML = f"""
[unifiedpush]
allow_private_endpoints = true
vapid_subject = "{SUBJECT}"

[iris]
notification_url = "{NOTIFICATION_URL}"
"""
BROWSER = "browser"



def _claims(request: PushRequest) -> tuple[dict[str, Any], str]:
    """The VAPID JWT's claims (the fake verified its signature before accepting) and `k`."""
    token, key = parse_vapid(request.headers["authorization"])
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))), key


class Browser:
    """The browser's push subscription: its keys, and what its push service accepted for it,
    decrypted."""

    def __init__(self, push: FakeUnifiedPush) -> None:
        self.keys = BrowserKeys()
        self.push = push
        self.endpoint = push.endpoint(BROWSER)

    def messages(self) -> list[dict[str, Any]]:
        return [
            json.loads(http_ece.decrypt(
                request.body, private_key=self.keys.private_key,
                auth_secret=self.keys.auth_secret, version="aes128gcm",
            ))
            for request in self.push.received(BROWSER) if request.status == 201
        ]

    def pushed(self, event: dict[str, Any]) -> int:
        return sum(1 for m in self.messages() if m["event"].get("id") == event["id"])


@pytest.fixture
def push_service() -> Iterator[FakeUnifiedPush]:
    fake = FakeUnifiedPush()
    fake.script.require_vapid = True
    fake.start()
    yield fake
    fake.stop()


async def test_iris_client_in_its_own_order_gets_decryptable_vapid_signed_pushes(
    start_relay: Callable[..., RelayProcess],
    start_service: Callable[..., ServiceProcess],
    push_service: FakeUnifiedPush,
) -> None:
    relay = start_relay("a")
    service = start_service([relay.url], FAST_RECONNECT + IRIS_TOML)
    me = SdkUser()
    session, rotated = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    bob, dave = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    with httpx.Client(base_url=service.url, timeout=scaled(REQUEST_SECONDS)) as http:
        # the user typed the instance's URL with a trailing slash, as Iris needs for a path
        iris = IrisClient(http, me, service.url + "/")

        # 1. what Iris reads first: the VAPID key, handed to the browser's subscribe()
        vapid_key = iris.info()["vapid_public_key"]
        browser = Browser(push_service)
        push_service.script.restricted[BROWSER] = vapid_key
        # 2. its own subscriptions so far: none
        assert iris.subscriptions() == {}
        # 3. its two syncs at once, in the same second: one auth event id, two signatures
        web_push = [browser.keys.subscription(browser.endpoint)]
        mentions = {"filter": {"#p": [me.hex], "kinds": [1, 6, 7, 9735]},
                    "web_push_subscriptions": web_push, "webhooks": []}
        messages = {"filter": {"kinds": [1060], "authors": [hex_of(session)]},
                    "web_push_subscriptions": web_push, "webhooks": []}
        second = int(time.time())
        created = [iris.request("POST", "subscriptions", body, created_at=second)
                   for body in (mentions, messages)]
        assert [r.status_code for r in created] == [201, 201], [r.text for r in created]
        stored = iris.subscriptions()
        assert {k: {key: v for key, v in s.items() if key != "subscriber"}
                for k, s in stored.items()} == {
            created[0].json()["id"]: mentions, created[1].json()["id"]: messages,
        }
        await eventually(lambda: relay_subscribed(service, relay.url), "the watch REQ sent")

        # 4. a mention, and a message by the session key: one push each, decrypted
        mention = signed_event(bob, 1, [["p", me.hex]], "gm iris")
        message = signed_event(session, 1060, [["p", "ab" * 32]], "double-ratchet ciphertext")
        await publish(relay.url, mention, message)
        await eventually(lambda: browser.pushed(mention) == 1 and browser.pushed(message) == 1,
                         "the mention and the message pushed to the browser")
        by_id = {m["event"]["id"]: m for m in browser.messages()}
        assert by_id[mention["id"]]["event"] == mention
        assert by_id[mention["id"]]["title"].startswith("Mention")
        assert by_id[mention["id"]]["body"] == "gm iris"
        assert by_id[mention["id"]]["url"].startswith(NOTIFICATION_URL + "note1")
        assert by_id[message["id"]]["event"] == message and by_id[message["id"]]["body"] == ""

        # 5. key rotation: Iris finds its subscription by reading it back, and re-posts it
        found = iris.subscriptions()
        [(dm_id, dm_sub)] = [(k, s) for k, s in found.items() if s["filter"]["kinds"] == [1060]]
        dm_sub["filter"] = {"kinds": [1060], "authors": [hex_of(rotated)]}
        updated = iris.request("POST", f"subscriptions/{dm_id}", dm_sub)
        assert updated.status_code == 200 and updated.json() == {"status": "Updated"}
        new_key = signed_event(rotated, 1060, [["p", "ab" * 32]], "after rotation")
        await publish(relay.url, new_key)
        await eventually(lambda: browser.pushed(new_key) == 1, "the new session key's message")
        old_key = signed_event(session, 1060, [["p", "ab" * 32]], "old session")
        marker = signed_event(dave, 7, [["p", me.hex]], "+")
        await publish(relay.url, old_key, marker)
        await eventually(lambda: browser.pushed(marker) == 1, "a later reaction pushed")
        assert browser.pushed(old_key) == 0

        # 6. deletion: the messages subscription is gone, the mentions one still works
        assert iris.request("DELETE", f"subscriptions/{dm_id}").status_code == 204
        assert set(iris.subscriptions()) == {created[0].json()["id"]}
        gone = signed_event(rotated, 1060, [["p", "ab" * 32]], "after deletion")
        marker = signed_event(dave, 1, [["p", me.hex]], "still there?")
        await publish(relay.url, gone, marker)
        await eventually(lambda: browser.pushed(marker) == 1, "a later mention pushed")
        assert browser.pushed(gone) == 0

    # every push the service sent was accepted: VAPID verified by the push service (aud its
    # origin, exp within 24 h, sub set, k the key /info gave) and decryptable by the browser
    sent = push_service.received(BROWSER)
    assert sent and all(request.status == 201 for request in sent), [r.status for r in sent]
    for request in sent:
        claims, key = _claims(request)
        assert key.rstrip("=") == vapid_key.rstrip("=")
        assert claims["aud"] == push_service.origin and claims["sub"] == SUBJECT
        assert time.time() < claims["exp"] <= time.time() + 24 * 3600
        assert request.headers["content-encoding"] == "aes128gcm" and request.headers["ttl"]
    assert len(browser.messages()) == len(sent) == 5  # one per event, none twice
    assert_private(service, [me.hex, hex_of(session), hex_of(rotated), hex_of(bob)])
