"""The senders of Iris targets against a loopback push service that checks VAPID as autopush
does (aud, exp, sub, and k bound to our key), each message decrypted with the subscription's
private key (http_ece, not our code); webhooks; dead and refused endpoints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nostr_sdk
import pytest

from sigil_push.iris.payload import event_url, planned
from sigil_push.push.base import Status, WakeupMessage
from sigil_push.push.iris_senders import IrisBodies, IrisWebPushSender, WebhookSender
from sigil_push.push.vapid import VapidSigner, load_or_create_key
from sigil_push.store.records import Device, WebPushKeys
from testkit.fakes.credentials import WebPushSubscriber
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush, verify_vapid
from testkit.fakes.http_server import Receive, Scope, Send, ServerThread, read_body, respond

URL = "https://iris.to/"
SUBJECT = "mailto:ops@example.org"


@pytest.fixture
def fake_push() -> Iterator[FakeUnifiedPush]:
    fake = FakeUnifiedPush().start()
    yield fake
    fake.stop()


def signed(kind: int, content: str, keys: nostr_sdk.Keys,
           tags: list[list[str]] | None = None) -> dict[str, Any]:
    event = (
        nostr_sdk.EventBuilder(nostr_sdk.Kind(kind), content)
        .tags([nostr_sdk.Tag.parse(t) for t in tags or []])
        .finalize(keys)
    )
    return dict(json.loads(event.as_json()))


def message(event: dict[str, Any], relay: str = "") -> WakeupMessage:
    return WakeupMessage((event["id"],), planned(json.dumps(event), relay), "c", 3600, False)


def device(platform: str, token: str, subscriber: WebPushSubscriber | None = None) -> Device:
    keys = WebPushKeys(subscriber.p256dh, subscriber.auth) if subscriber else None
    return Device(7, "b" * 64, platform, token, "iris", (), keys, 0)


def vapid(tmp_path: Path) -> VapidSigner:
    return VapidSigner(load_or_create_key(tmp_path / "vapid.pem"), SUBJECT)


async def test_a_web_push_is_vapid_signed_and_decrypts_to_the_iris_json(
    tmp_path: Path, fake_push: FakeUnifiedPush
) -> None:
    signer = vapid(tmp_path)
    fake_push.script.restricted["browser"] = signer.public_key
    browser = WebPushSubscriber.generate()
    author = nostr_sdk.Keys.generate()
    # authors' names come from their relay (tests/iris/test_iris_delivery.py): none here
    sender = IrisWebPushSender(True, 10, signer, IrisBodies(URL, None))
    note = signed(1, "hello there", author, [["p", "b" * 64]])
    dm = signed(1060, "ciphertext", author)
    try:
        for event in (note, dm):
            outcome = await sender.send(message(event), device("webpush", fake_push.endpoint("browser"), browser))
            assert outcome.status is Status.ACCEPTED, outcome
    finally:
        await sender.close()
    first, second = fake_push.received("browser")
    assert (first.status, second.status) == (201, 201)
    claims = verify_vapid(first.headers["authorization"], fake_push.origin, signer.public_key)
    assert claims["sub"] == SUBJECT and claims["aud"] == fake_push.origin
    assert first.headers["urgency"] == "normal" and second.headers["urgency"] == "high"
    assert first.headers["ttl"] == "3600" and first.headers["content-encoding"] == "aes128gcm"
    assert first.headers["topic"] != second.headers["topic"] and len(first.headers["topic"]) <= 32
    shown = json.loads(browser.decrypt(first.body))
    assert shown == {"event": note, "title": "Mention", "body": "hello there",
                     "url": event_url(URL, note["id"])}
    private = json.loads(browser.decrypt(second.body))
    assert private == {"event": dm, "title": "DM", "body": "", "url": event_url(URL, dm["id"])}
    assert b"hello there" not in first.body and note["pubkey"].encode() not in first.body


async def test_dead_endpoints_are_unregistered_and_refusals_rejected(
    tmp_path: Path, fake_push: FakeUnifiedPush
) -> None:
    """404 and 410 mean the subscription is gone (delivery forgets the device, which removes
    it from every Iris subscription); a push service refusing our VAPID key is a rejection; a
    planned push without its event is not sent at all."""
    signer = vapid(tmp_path)
    fake_push.script.answers["gone"] = (410, None)
    fake_push.script.answers["missing"] = (404, None)
    fake_push.script.restricted["other-key"] = "B" + "A" * 86
    browser = WebPushSubscriber.generate()
    sender = IrisWebPushSender(True, 10, signer, IrisBodies(URL, None))
    event = signed(7, "+", nostr_sdk.Keys.generate(), [["p", "b" * 64]])
    try:
        gone = await sender.send(message(event), device("webpush", fake_push.endpoint("gone"), browser))
        missing = await sender.send(message(event), device("webpush", fake_push.endpoint("missing"), browser))
        refused = await sender.send(message(event), device("webpush", fake_push.endpoint("other-key"), browser))
        empty = WakeupMessage(("x",), planned(None, ""), "c", 60, False)
        nothing = await sender.send(empty, device("webpush", fake_push.endpoint("empty"), browser))
    finally:
        await sender.close()
    assert gone.status is Status.UNREGISTERED and missing.status is Status.UNREGISTERED
    assert refused.status is Status.REJECTED
    assert nothing.status is Status.REJECTED and fake_push.received("empty") == []


async def test_an_endpoint_on_a_private_address_is_refused_unless_tests_allow_it(tmp_path: Path) -> None:
    """The outbound guard of UnifiedPush: without `allow_private_endpoints`, loopback and
    plain http:// are refused before any connection."""
    browser = WebPushSubscriber.generate()
    sender = IrisWebPushSender(False, 10, vapid(tmp_path), IrisBodies(URL, None))
    hook = WebhookSender(False, 10, IrisBodies(URL, None))
    event = signed(7, "+", nostr_sdk.Keys.generate(), [["p", "b" * 64]])
    try:
        pushed = await sender.send(message(event), device("webpush", "https://127.0.0.1:9/up/x", browser))
        posted = await hook.send(message(event), device("webhook", "https://127.0.0.1:9/hook"))
    finally:
        await sender.close()
        await hook.close()
    assert pushed.status is Status.REJECTED and pushed.detail == "unsafe endpoint"
    assert posted.status is Status.REJECTED and posted.detail == "unsafe endpoint"


async def test_a_webhook_gets_the_json_in_a_post() -> None:
    received: list[tuple[dict[str, str], bytes]] = []

    async def hook(scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        received.append(({k.decode(): v.decode() for k, v in scope["headers"]}, body))
        await respond(send, 200 if scope["path"] == "/hook" else 410)

    server = ServerThread(hook).start()
    sender = WebhookSender(True, 10, IrisBodies(URL, None))
    event = signed(6, "", nostr_sdk.Keys.generate(), [["p", "b" * 64]])
    base = f"http://127.0.0.1:{server.port}"
    try:
        outcome = await sender.send(message(event), device("webhook", base + "/hook"))
        gone = await sender.send(message(event), device("webhook", base + "/gone"))
    finally:
        await sender.close()
        server.stop()
    assert outcome.status is Status.ACCEPTED and gone.status is Status.UNREGISTERED
    headers, body = received[0]
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"event": event, "title": "Repost", "body": "",
                                "url": event_url(URL, event["id"])}
