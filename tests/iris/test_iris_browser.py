"""Iris's pushes in a real browser: headless Chromium (Debian's package, driven by Playwright)
runs a service worker that handles pushes as Iris's does (testkit/iris_browser/sw.js).

Headless Chromium has no push service, so the page's `PushManager.subscribe` is replaced by a
subscription holding a test-owned P-256 key pair and auth secret, whose endpoint is a loopback
stand-in push service checking VAPID as autopush does. Our Web Push sender pushes there; the
test decrypts each message with the subscription's private key (http_ece) and hands the
plaintext to the worker with the DevTools command `ServiceWorker.deliverPushMessage`, as a
browser's push service would, then reads `registration.getNotifications()`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nostr_sdk
import pytest
from playwright.sync_api import Worker, sync_playwright

from sigil_push.iris.payload import planned
from sigil_push.nostr.nip19 import encode_note
from sigil_push.push.base import Status, WakeupMessage
from sigil_push.push.iris_senders import IrisBodies, IrisWebPushSender
from sigil_push.push.vapid import VapidSigner, load_or_create_key
from sigil_push.store.records import Device, WebPushKeys
from testkit.deadlines import STARTUP_SECONDS, scaled, wait_until
from testkit.fakes.credentials import WebPushSubscriber
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush
from testkit.fakes.http_server import Receive, Scope, Send, ServerThread, read_body, respond

pytestmark = pytest.mark.slow  # starts a browser

CHROMIUM = "/usr/bin/chromium"
SITE = Path(__file__).resolve().parents[2] / "testkit" / "iris_browser"
NOTIFICATION_URL = "https://iris.example/"


def site_app() -> Callable[[Scope, Receive, Send], Any]:
    files = {"/index.html": ("text/html", "index.html"), "/sw.js": ("text/javascript", "sw.js")}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        found = files.get(scope["path"])
        if found is None:
            await respond(send, 404)
            return
        media, name = found
        await respond(send, 200, (SITE / name).read_bytes(), {"content-type": media})

    return app


def fake_subscribe_script(endpoint: str, subscriber: WebPushSubscriber) -> str:
    subscription = json.dumps(
        {"endpoint": endpoint, "expirationTime": None,
         "keys": {"p256dh": subscriber.p256dh, "auth": subscriber.auth}}
    )
    return (SITE / "fake_subscribe.js").read_text().replace("__SUBSCRIPTION__", subscription)


def signed(kind: int, content: str, tags: list[list[str]]) -> dict[str, Any]:
    event = nostr_sdk.EventBuilder(nostr_sdk.Kind(kind), content).tags(
        [nostr_sdk.Tag.parse(t) for t in tags]
    ).finalize(nostr_sdk.Keys.generate())
    return dict(json.loads(event.as_json()))


async def push_through_sender(
    events: list[dict[str, Any]], endpoint: str, subscriber: WebPushSubscriber, vapid: VapidSigner
) -> None:
    sender = IrisWebPushSender(True, 10, vapid, IrisBodies(NOTIFICATION_URL, None))
    device = Device(1, "b" * 64, "webpush", endpoint, "iris", (),
                    WebPushKeys(subscriber.p256dh, subscriber.auth), 0)
    try:
        for event in events:
            message = WakeupMessage((event["id"],), planned(json.dumps(event), ""), "c", 60, False)
            outcome = await sender.send(message, device)
            assert outcome.status is Status.ACCEPTED, outcome
    finally:
        await sender.close()


@pytest.fixture
def push_service() -> Iterator[FakeUnifiedPush]:
    fake = FakeUnifiedPush().start()
    yield fake
    fake.stop()


def test_the_worker_shows_iris_pushes_decrypted_from_our_web_push(
    tmp_path: Path, push_service: FakeUnifiedPush
) -> None:
    vapid = VapidSigner(load_or_create_key(tmp_path / "vapid.pem"), "mailto:ops@example.org")
    push_service.script.restricted["browser"] = vapid.public_key  # k must be /info's key
    endpoint = push_service.endpoint("browser")
    subscriber = WebPushSubscriber.generate()
    mention = signed(1, "gm, are you there?", [["p", "b" * 64]])
    private = signed(1060, "double ratchet ciphertext", [])
    while_visible = signed(7, "+", [["p", "b" * 64]])
    asyncio.run(push_through_sender([while_visible, mention, private], endpoint, subscriber, vapid))
    received = push_service.received("browser")
    assert [r.status for r in received] == [201, 201, 201]
    plaintexts = [subscriber.decrypt(r.body).decode() for r in received]
    no_event = json.dumps({"title": "Mention", "body": "no event here", "url": NOTIFICATION_URL})

    site = ServerThread(site_app()).start()
    origin = f"http://127.0.0.1:{site.port}"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"],
                timeout=scaled(STARTUP_SECONDS) * 1000,
            )
            try:
                context = browser.new_context()
                context.grant_permissions(["notifications"], origin=origin)
                context.add_init_script(fake_subscribe_script(endpoint, subscriber))
                page = context.new_page()
                cdp = context.new_cdp_session(page)
                registrations: list[dict[str, Any]] = []
                cdp.on("ServiceWorker.workerRegistrationUpdated",
                       lambda update: registrations.extend(update["registrations"]))
                cdp.send("ServiceWorker.enable")
                page.goto(origin + "/index.html")
                subscription = page.evaluate("window.subscribed")
                assert subscription["endpoint"] == endpoint
                assert subscription["keys"]["p256dh"] == subscriber.p256dh
                registration_id = wait_until(
                    lambda: next((r["registrationId"] for r in registrations
                                  if r["scopeURL"].startswith(origin) and not r["isDeleted"]), None),
                    "the worker's registration",
                )
                worker = wait_until(lambda: context.service_workers[0] if context.service_workers else None,
                                    "the service worker")

                def deliver(data: str) -> None:
                    cdp.send("ServiceWorker.deliverPushMessage",
                             {"origin": origin, "registrationId": registration_id, "data": data})

                def notifications(service_worker: Worker) -> list[dict[str, Any]]:
                    return list(service_worker.evaluate(
                        "self.registration.getNotifications().then(list => list.map(n =>"
                        " ({title: n.title, body: n.body, url: n.data && n.data.url})))"
                    ))

                deliver(plaintexts[0])
                wait_until(lambda: worker.evaluate("self.ignored || 0") == 1, "the visible-window push")
                assert notifications(worker) == []

                page.goto("about:blank")
                wait_until(lambda: not current(context).evaluate(
                    "self.clients.matchAll({type: 'window', includeUncontrolled: true})"
                    ".then(list => list.some(c => c.visibilityState === 'visible'))"
                ), "no visible window of the origin")
                for data in (no_event, plaintexts[1], plaintexts[2]):
                    deliver(data)
                wait_until(lambda: current(context).evaluate(
                    "(self.shown || 0) + (self.failed ? 1 : 0) >= 2"
                ), "two notifications shown")
                assert current(context).evaluate("self.failed || null") is None, state(context)
                shown = notifications(current(context))
                assert len(shown) == 2, state(context)
                assert current(context).evaluate("self.dropped || 0") == 1
            finally:
                browser.close()
    finally:
        site.stop()
    by_title = {n["title"]: n for n in shown}
    assert set(by_title) == {"Mention", "New private message"}
    assert by_title["Mention"]["body"] == "gm, are you there?"
    assert by_title["Mention"]["url"] == origin + "/" + encode_note(mention["id"])
    assert "double ratchet" not in json.dumps(shown)


def state(context: Any) -> str:
    """What the worker saw, for a failure's message."""
    return str(current(context).evaluate(
        "JSON.stringify({ignored: self.ignored || 0, dropped: self.dropped || 0,"
        " shown: self.shown || 0, failed: self.failed || null,"
        " last: self.lastPush ? Object.keys(self.lastPush) : null})"
    ))


def current(context: Any) -> Worker:
    """The live service worker (Chromium may have restarted it between pushes)."""
    workers: list[Worker] = context.service_workers
    return workers[-1]
