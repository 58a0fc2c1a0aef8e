"""An outbox row for an Iris target goes out through the real Delivery loop, on both engines:
Web Push (decrypted with the subscription's key) and a webhook get the Iris JSON; a browser
endpoint answering 410 is removed from every subscription, and a subscription left without a
target is deleted; a target past its budget (burst 20) has the excess suppressed, counted.

The matching that writes these rows is the bridge's (issue 33's other half); here rows are
queued with `OutboxStore.enqueue`, as the committer does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from sigil_push.config import parse_config
from sigil_push.delivery import Delivery
from sigil_push.iris.payload import event_url
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.push.factory import build_senders
from sigil_push.push.registry import TABLES
from sigil_push.push.vapid import load_or_create_key, public_key_b64
from sigil_push.store.interface import IrisTarget
from sigil_push.store.records import Device
from testkit.bridge_harness import eventually, eventually_async
from testkit.fakes.credentials import WebPushSubscriber
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush
from testkit.fakes.http_server import Receive, Scope, Send, ServerThread, read_body, respond
from testkit.nostr_client import publish
from testkit.relay import RelayProcess

NOTIFICATION_URL = "https://iris.example/"
RELAY = "ws://127.0.0.1:9"  # nothing listens: no author's name, the push goes without it


@pytest.fixture
def fake_push() -> Iterator[FakeUnifiedPush]:
    fake = FakeUnifiedPush().start()
    yield fake
    fake.stop()


def suppressed(reason: str) -> float:
    return REGISTRY.get_sample_value("sigil_push_suppressed_total", {"reason": reason}) or 0.0


async def start_delivery(store: Any, tmp_path: Path) -> Delivery:
    document = {
        "server": {"public_url": "https://push.example.org"},
        "unifiedpush": {"allow_private_endpoints": True, "vapid_subject": "mailto:ops@example.org",
                        "vapid_private_key_file": str(tmp_path / "vapid.pem")},
        "iris": {"notification_url": NOTIFICATION_URL},
        "webhooks": {"enabled": True, "allow_private_endpoints": True},
        "limits": {"wakeups_per_minute_per_device": 0},
    }
    config = parse_config(document, tmp_path / "relays.toml", TABLES)
    observations = ObservationLog(tmp_path / "observations")
    delivery = Delivery(store.outbox, store.devices, await build_senders(config), observations,
                        True, config.push, config.limits, None, config.iris)
    await delivery.start()
    return delivery


async def target_devices(store: Any, subscription_id: str) -> list[Device]:
    stored = await store.iris.get(subscription_id)
    assert stored is not None
    devices = [await store.devices.by_id(device_id) for device_id in stored.device_ids]
    return [d for d in devices if d is not None]


async def test_iris_targets_get_the_json_and_a_gone_endpoint_leaves_every_subscription(
    store: Any, tmp_path: Path, fake_push: FakeUnifiedPush
) -> None:
    vapid_key = public_key_b64(load_or_create_key(tmp_path / "vapid.pem"))
    fake_push.script.restricted["browser"] = vapid_key
    fake_push.script.answers["gone"] = (410, None)
    hooked: list[bytes] = []

    async def hook(scope: Scope, receive: Receive, send: Send) -> None:
        hooked.append(await read_body(receive))
        await respond(send, 204)

    webhook_server = ServerThread(hook).start()
    webhook = f"http://127.0.0.1:{webhook_server.port}/hook"
    subscriber, author = SecretKey.generate(), SecretKey.generate()
    browser, old_browser = WebPushSubscriber.generate(), WebPushSubscriber.generate()
    browser_target = IrisTarget("webpush", fake_push.endpoint("browser"), browser.p256dh, browser.auth)
    gone_target = IrisTarget("webpush", fake_push.endpoint("gone"), old_browser.p256dh, old_browser.auth)
    me = subscriber.public_key_hex
    # Iris's two subscriptions on one browser endpoint, one also naming an old endpoint and a
    # webhook, and a third whose only target is the old endpoint
    await store.iris.put("mentions", me, "{}", [browser_target, gone_target], 20)
    await store.iris.put("dms", me, "{}", [browser_target, IrisTarget("webhook", webhook, None, None)], 20)
    await store.iris.put("old", me, "{}", [gone_target], 20)
    devices = {d.token: d for d in await target_devices(store, "mentions") + await target_devices(store, "dms")}
    assert len(devices) == 3, "one device per endpoint, whatever the number of subscriptions"

    note = sign_event(author, 1, "gm, are you there?", [["p", me]])
    await store.outbox.enqueue(note, RELAY, now_ms(), list(devices.values()))
    delivery = await start_delivery(store, tmp_path)
    try:
        await eventually(lambda: fake_push.received("browser") and hooked, what="both pushes")
        await eventually_async(lambda: _gone(store), what="the 410 endpoint removed")
    finally:
        await delivery.stop()
        webhook_server.stop()
    [request] = fake_push.received("browser")
    assert request.headers["urgency"] == "normal" and request.headers["content-encoding"] == "aes128gcm"
    expected = {"event": note.to_json(), "title": "Mention", "body": "gm, are you there?",
                "url": event_url(NOTIFICATION_URL, note.id)}
    assert json.loads(browser.decrypt(request.body)) == expected
    assert json.loads(hooked[0]) == expected
    assert await store.iris.get("old") is None, "left without targets: deleted"
    remaining = {d.token for d in await target_devices(store, "mentions")}
    assert remaining == {browser_target.token}
    assert await store.outbox.depth() == 0


async def _gone(store: Any) -> bool:
    return await store.iris.get("old") is None


async def test_a_target_past_its_burst_has_the_excess_suppressed(
    store: Any, tmp_path: Path, fake_push: FakeUnifiedPush
) -> None:
    subscriber, author = SecretKey.generate(), SecretKey.generate()
    browser = WebPushSubscriber.generate()
    target = IrisTarget("webpush", fake_push.endpoint("busy"), browser.p256dh, browser.auth)
    await store.iris.put("s", subscriber.public_key_hex, "{}", [target], 20)
    [device] = await target_devices(store, "s")
    for n in range(25):
        reaction = sign_event(author, 7, "+", [["p", subscriber.public_key_hex], ["e", f"{n:064x}"]])
        await store.outbox.enqueue(reaction, RELAY, now_ms(), [device])
    before = suppressed("rate_limited")
    delivery = await start_delivery(store, tmp_path)
    try:
        await eventually_async(lambda: _empty(store), what="the outbox drained")
    finally:
        await delivery.stop()
    assert len(fake_push.received("busy")) == 20
    assert suppressed("rate_limited") == before + 5


async def _empty(store: Any) -> bool:
    return await store.outbox.depth() == 0


@pytest.mark.slow  # starts a relay
async def test_the_push_names_its_author_from_the_relay_the_event_came_from(
    store: Any, tmp_path: Path, fake_push: FakeUnifiedPush
) -> None:
    """The whole send path with a real relay (nostr-relay) holding the author's kind 0: the
    Web Push's title names them and its icon is their picture; a DM's never do."""
    subscriber, author = SecretKey.generate(), SecretKey.generate()
    profile = sign_event(author, 0, json.dumps({"name": "alice", "picture": "https://p.example/a.png"}), [])
    browser = WebPushSubscriber.generate()
    target = IrisTarget("webpush", fake_push.endpoint("named"), browser.p256dh, browser.auth)
    await store.iris.put("s", subscriber.public_key_hex, "{}", [target], 20)
    [device] = await target_devices(store, "s")
    with RelayProcess(tmp_path / "relay") as relay:
        await publish(relay.url, profile.to_json())
        reply = sign_event(author, 1, "indeed", [["e", "e" * 64, "", "reply"], ["p", subscriber.public_key_hex]])
        dm = sign_event(author, 4, "ciphertext?iv=abc", [["p", subscriber.public_key_hex]])
        await store.outbox.enqueue(reply, relay.url, now_ms(), [device])
        await store.outbox.enqueue(dm, relay.url, now_ms(), [device])
        delivery = await start_delivery(store, tmp_path)
        try:
            await eventually(lambda: len(fake_push.received("named")) == 2, what="both pushes")
        finally:
            await delivery.stop()
    shown = {json.loads(browser.decrypt(r.body))["event"]["kind"]: json.loads(browser.decrypt(r.body))
             for r in fake_push.received("named")}
    assert shown[1]["title"] == "Reply from alice" and shown[1]["icon"] == "https://p.example/a.png"
    assert (shown[4]["title"], shown[4]["body"]) == ("DM", "") and "icon" not in shown[4]
