"""Iris subscriptions with `apns_tokens` and `fcm_tokens`, end to end (issue 33): an Iris client
(testkit.iris_client: `btoa` NIP-98 without `payload`, trailing-slash URLs) stores them on a
real `sigil-push serve` whose `[apns]` and `[fcm]` tables point at the local HTTP/2 APNs and
FCM fakes (the real aioapns and firebase-admin clients send to them), events are published to
a real `nostr-relay`, and what Apple and Google received is read back from the fakes.

What they may read is a wakeup and no more: the Iris JSON's keys, with `event` only when its
content is ciphertext (kinds 4, 1059, 1060), a generic title (no amount, no name), an empty
body, no icon, and a `url` that names no public event; no key, npub or content anywhere in the
body or headers outside that ciphertext event. A token the provider calls dead (APNs 410
`Unregistered`, FCM `UNREGISTERED`) leaves every subscription naming it, as a gone Web Push
endpoint does, and a subscription left without targets is deleted: on both store engines.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import nostr_sdk
import pytest

from testkit.bridge_harness import assert_private, eventually, relay_subscribed
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.fakes.fake_apns import ApnsRequest, FakeApns
from testkit.fakes.fake_fcm import FakeFcm
from testkit.fakes.harness import Credentials, provider_tables, toml_tables
from testkit.iris_client import IrisClient
from testkit.nip98 import SdkUser
from testkit.nostr_client import gift_wrap, hex_of, kind4_dm, npub_of, publish, signed_event
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import Engine, fetch

pytestmark = pytest.mark.slow  # starts its own processes

NOTIFICATION_URL = "https://iris.example/"
CIPHERTEXT_KINDS = {4, 1059, 1060}
GENERIC_TITLES = {"Mention", "Reply", "Repost", "Reaction", "Zap", "DM"}
APS = {"alert": {"title": "Sigil", "body": "New message"}, "mutable-content": 1, "sound": "default"}


@pytest.fixture
def providers_toml(
    credentials: Credentials, fake_apns: FakeApns, fake_fcm_server: tuple[FakeFcm, Path]
) -> Iterator[str]:
    """`[apns]` and `[fcm]` on the session's fakes (no `[unifiedpush]`), `[iris]`'s url; the
    answers this test scripts are cleared after it (the fakes serve the whole session)."""
    tables = provider_tables(credentials, fake_apns, fake_fcm_server)
    del tables["unifiedpush"]
    yield toml_tables(tables) + f'[iris]\nnotification_url = "{NOTIFICATION_URL}"\n'
    fake_apns.script.answers.clear()
    fake_fcm_server[0].script.answers.clear()


def apns_token() -> str:
    return os.urandom(32).hex()


def fcm_token() -> str:
    return "iris-fcm-" + os.urandom(24).hex()


def to_apns(fake: FakeApns, token: str) -> list[ApnsRequest]:
    return [r for r in fake.requests if r.token == token]


def to_fcm(fake: FakeFcm, token: str) -> list[dict[str, Any]]:
    return [m for m in fake.messages if m["token"] == token]


def zap(zapper: nostr_sdk.Keys, recipient: str, comment: str) -> dict[str, Any]:
    """A NIP-57 zap receipt (signed by a wallet's key) of `zapper`'s request with `comment`."""
    request = signed_event(zapper, 9734, [["p", recipient], ["amount", "21000"]], comment)
    wallet = nostr_sdk.Keys.generate()
    return signed_event(wallet, 9735, [["p", recipient], ["description", json.dumps(request)],
                                       ["bolt11", "lnbc210n1fake"]])


TITLES = {1: "Mention", 7: "Reaction", 9735: "Zap"}
"""The generic title of each public kind published here (a zap's names no amount)."""


def assert_wakeups_only(
    pushes: list[dict[str, Any]], events: list[dict[str, Any]], secrets: list[str]
) -> None:
    """What one provider received (APNs bodies without `aps`, or FCM data), one push per
    event: the Iris keys, `event` only for ciphertext (and then the event as published),
    nothing else readable. A public event's push can't say which event it is: its id finds it
    (author, content, the keys it names) on any relay, so it is a secret too."""
    ciphertext = {e["id"]: e for e in events if e["kind"] in CIPHERTEXT_KINDS}
    public = [e for e in events if e["kind"] not in CIPHERTEXT_KINDS]
    secrets = [*secrets, *(e["id"] for e in public), *(e["content"] for e in events if e["content"])]
    carried, titles = [], []
    for data in pushes:
        readable = {key: value for key, value in data.items() if key != "event"}
        assert set(readable) == {"title", "body", "url"}, readable
        assert readable["title"] in GENERIC_TITLES and readable["body"] == ""
        if "event" in data:
            event = json.loads(data["event"])
            assert event == ciphertext[event["id"]]
            assert readable["title"] == "DM" and readable["url"].startswith(NOTIFICATION_URL + "note1")
            carried.append(event["id"])
        else:
            assert readable["url"] == NOTIFICATION_URL
            titles.append(readable["title"])
        text = json.dumps(readable, ensure_ascii=False)
        for secret in secrets:
            assert secret not in text, f"{secret[:16]}… readable by the provider"
    assert sorted(carried) == sorted(ciphertext), "each ciphertext event once, with its event"
    assert sorted(titles) == sorted(TITLES[e["kind"]] for e in public), "each public one once"


async def test_apple_and_google_get_a_wakeup_and_the_ciphertext_only(
    start_relay: Callable[..., RelayProcess],
    start_service: Callable[..., ServiceProcess],
    providers_toml: str,
    fake_apns: FakeApns,
    fake_fcm: FakeFcm,
) -> None:
    relay = start_relay("a")
    service = start_service([relay.url], FAST_RECONNECT + providers_toml)
    me, bob, session = SdkUser(), nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    apns, fcm = apns_token(), fcm_token()
    with httpx.Client(base_url=service.url, timeout=scaled(REQUEST_SECONDS)) as http:
        iris = IrisClient(http, me, service.url + "/")
        # Iris's two subscriptions, both naming the phone's tokens; a DM matches both
        mentions = {"filter": {"#p": [me.hex], "kinds": [1, 4, 7, 1059, 9735]},
                    "apns_tokens": [apns.upper()], "fcm_tokens": [fcm]}
        messages = {"filter": {"kinds": [1060], "authors": [hex_of(session)]},
                    "filters": [{"#p": [me.hex], "kinds": [4]}],
                    "apns_tokens": [apns], "fcm_tokens": [fcm]}
        created = [iris.request("POST", "subscriptions/", body, created_at=int(time.time()))
                   for body in (mentions, messages)]
        assert [r.status_code for r in created] == [201, 201], [r.text for r in created]
        shown = iris.subscriptions()
        assert shown[created[0].json()["id"]]["apns_tokens"] == [apns.upper()], "as sent"
    await eventually(lambda: relay_subscribed(service, relay.url), "the watch REQ sent")

    secret_text = "meet me at the old mill at nine"
    events = [
        signed_event(bob, 1, [["p", me.hex]], secret_text),
        signed_event(bob, 7, [["p", me.hex], ["e", "e" * 64]], "🤫"),
        zap(bob, me.hex, "for the secret plan"),
        kind4_dm(bob, me.keys, secret_text),
        signed_event(session, 1060, [["p", "ab" * 32]], "double-ratchet ciphertext"),
        gift_wrap(bob, me.keys, secret_text),
    ]
    await publish(relay.url, *events)
    await eventually(lambda: len(to_apns(fake_apns, apns)) >= len(events)
                     and len(to_fcm(fake_fcm, fcm)) >= len(events), "every event at both")
    by_id = {event["id"]: event for event in events}

    secrets = [me.hex, me.npub, hex_of(bob), npub_of(bob), "for the secret plan"]
    apns_requests, fcm_messages = to_apns(fake_apns, apns), to_fcm(fake_fcm, fcm)
    assert len(apns_requests) == len(fcm_messages) == len(events), "one push per event and token"
    bodies = []
    for request in apns_requests:
        body = dict(request.body)
        assert body.pop("aps") == APS, "the fixed alert, mutable-content for the app's extension"
        bodies.append(body)
        headers = json.dumps(request.headers)
        assert not any(secret in headers for secret in [me.hex, hex_of(bob), *by_id])
    assert_wakeups_only(bodies, events, secrets)
    for message in fcm_messages:
        assert set(message) == {"token", "data", "android"}, "data only: nothing shown by Android"
        assert "collapse_key" not in message["android"]
    assert_wakeups_only([m["data"] for m in fcm_messages], events, secrets)
    await eventually(lambda: len(push_records(service)) == 2 * len(events), "push records")
    assert {r["platform"] for r in push_records(service)} == {"ios", "android"}
    assert_private(service, [me.hex, me.npub, hex_of(bob), apns, fcm, secret_text])


def push_records(service: ServiceProcess) -> list[dict[str, Any]]:
    return [r for r in service.observation_records() if r["type"] == "push"]


def iris_rows(service: ServiceProcess, token: str) -> list[tuple[Any, ...]]:
    return fetch(service.database, "SELECT id FROM devices WHERE token = ?", (token,))


async def test_a_token_the_provider_calls_dead_leaves_every_subscription(
    engine: Engine,
    start_relay: Callable[..., RelayProcess],
    start_service: Callable[..., ServiceProcess],
    providers_toml: str,
    fake_apns: FakeApns,
    fake_fcm: FakeFcm,
) -> None:
    """APNs 410 Unregistered and FCM UNREGISTERED: the token leaves every subscription (the
    caller's and another user's), a subscription left without targets is deleted, the live
    tokens keep getting pushes, and the dead ones get no more."""
    relay = start_relay("a")
    service = start_service([relay.url], FAST_RECONNECT + providers_toml)
    me, carol, bob = SdkUser(), SdkUser(), nostr_sdk.Keys.generate()
    dead_apns, dead_fcm, live_fcm, carols_fcm = apns_token(), fcm_token(), fcm_token(), fcm_token()
    fake_apns.script.answers[dead_apns] = (410, "Unregistered")
    fake_fcm.script.answers[dead_fcm] = ("UNREGISTERED", None)
    with httpx.Client(base_url=service.url, timeout=scaled(REQUEST_SECONDS)) as http:
        mine, carols = IrisClient(http, me, service.url + "/"), IrisClient(http, carol, service.url + "/")
        dead_only = {"filter": {"#p": [me.hex], "kinds": [1]},
                     "apns_tokens": [dead_apns], "fcm_tokens": [dead_fcm]}
        mixed = {"filter": {"#p": [me.hex], "kinds": [7]},
                 "apns_tokens": [dead_apns], "fcm_tokens": [live_fcm]}
        # carol names the same dead APNs token (her phone's old token, or a copy)
        hers = {"filter": {"#p": [carol.hex], "kinds": [1]},
                "apns_tokens": [dead_apns], "fcm_tokens": [carols_fcm]}
        ids = {}
        for name, client, body in (("dead_only", mine, dead_only), ("mixed", mine, mixed),
                                   ("hers", carols, hers)):
            response = client.request("POST", "subscriptions", body)
            assert response.status_code == 201, response.text
            ids[name] = response.json()["id"]
        assert len(iris_rows(service, dead_apns)) == 2, "one target row per subscriber"
        await eventually(lambda: relay_subscribed(service, relay.url), "the watch REQ sent")

        mention = signed_event(bob, 1, [["p", me.hex], ["p", carol.hex]], "hello both")
        reaction = signed_event(bob, 7, [["p", me.hex]], "+")
        await publish(relay.url, mention, reaction)
        await eventually(lambda: to_fcm(fake_fcm, live_fcm) and to_fcm(fake_fcm, carols_fcm)
                         and to_fcm(fake_fcm, dead_fcm) and to_apns(fake_apns, dead_apns),
                         "the first pushes answered")
        await eventually(lambda: not iris_rows(service, dead_apns)
                         and not iris_rows(service, dead_fcm), "the dead tokens forgotten")
        await eventually(lambda: ids["dead_only"] not in mine.subscriptions(),
                         "the subscription left without targets deleted")
        assert mine.request("GET", f"subscriptions/{ids['dead_only']}").status_code == 404
        assert set(mine.subscriptions()) == {ids["mixed"]}
        assert set(carols.subscriptions()) == {ids["hers"]}
        assert iris_rows(service, live_fcm) and iris_rows(service, carols_fcm)

        pushed_dead = (len(to_apns(fake_apns, dead_apns)), len(to_fcm(fake_fcm, dead_fcm)))
        later = signed_event(bob, 7, [["p", me.hex], ["e", "f" * 64]], "+")
        later_hers = signed_event(bob, 1, [["p", carol.hex]], "still there?")
        await publish(relay.url, later, later_hers)
        await eventually(lambda: len(to_fcm(fake_fcm, live_fcm)) == 2
                         and len(to_fcm(fake_fcm, carols_fcm)) == 2, "later events pushed")
    assert (len(to_apns(fake_apns, dead_apns)), len(to_fcm(fake_fcm, dead_fcm))) == pushed_dead
    assert pushed_dead[1] == 1, "the dead FCM token was asked once"
    assert_private(service, [me.hex, carol.hex, dead_apns, dead_fcm, live_fcm, carols_fcm])
