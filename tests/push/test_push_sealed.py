"""Sealed previews, the push side (issue 21): what reaches the APNs, FCM and UnifiedPush fakes
for a `payload: "sealed"` registration, opened only with independent code: nostr-sdk's
nip44_decrypt, its event verification and its gift-wrap unwrapping, through the client example
in docs/examples/decrypt_sealed_push.py (which these tests thereby keep working).

The real Delivery loop and provider clients run in process over a real store (`make_harness`:
SQLite and PostgreSQL), against the fakes over sockets; DMs are built by nostr-sdk.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import nostr_sdk

from sigil_push.config import LimitsConfig, PushConfig, parse_config
from sigil_push.delivery import Delivery
from sigil_push.delivery.plan import Planner, PlatformPolicy
from sigil_push.nostr import nip44
from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip19 import encode_npub
from sigil_push.push.apns_sender import APS, apns_size
from sigil_push.push.factory import build_senders
from sigil_push.push.fcm_sender import fcm_size
from sigil_push.push.payload import MAX_PAYLOAD_BYTES, sealed_data
from sigil_push.push.registry import TABLES
from sigil_push.push.unifiedpush_sender import unifiedpush_size
from sigil_push.store.records import Device, Wakeup, WebPushKeys
from testkit.deadlines import COMMAND_SECONDS, scaled
from testkit.fakes.credentials import WebPushSubscriber
from testkit.fakes.fake_apns import ApnsRequest, FakeApns
from testkit.fakes.fake_fcm import FakeFcm
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush
from testkit.fakes.harness import (
    RELAY,
    Harness,
    apns_token,
    document,
    eventually,
    fcm_token,
    provider_tables,
)
from testkit.in_process import in_process_bridge
from testkit.nostr_client import gift_wrap, kind4_dm

EXAMPLE_PATH = Path(__file__).resolve().parents[2] / "docs" / "examples" / "decrypt_sealed_push.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("decrypt_sealed_push", EXAMPLE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


class Phone:
    """The app's side: a device key pair made on the phone, and the account's own keys."""

    def __init__(self, harness: Harness) -> None:
        self.device_key = SecretKey.generate()
        self.account = nostr_sdk.Keys.parse(harness.recipient_key.secret_hex)
        self.sender = nostr_sdk.Keys.parse(harness.sender_key.secret_hex)

    def open(self, push: dict[str, Any]) -> dict[str, Any]:
        plaintext: dict[str, Any] = example.open_sealed(push, self.device_key.secret_hex)
        return plaintext

    def read(self, push: dict[str, Any]) -> tuple[str, str]:
        """(sender hex, text) of the DM inside, verified and opened with the account's key."""
        event = example.verified_event(self.open(push))
        sender, text = example.read_message(event, self.account.secret_key().to_hex())
        return str(sender), str(text)


async def _register(harness: Harness, phone: Phone, platform: str, token: str,
                    keys: WebPushKeys | None = None) -> Device:
    registration = await harness.devices.register(
        harness.recipient_key.public_key_hex, platform, token, "sealed", (), keys, 0,
        device_key=phone.device_key.public_key_hex,
    )
    return registration.device


async def _enqueue(harness: Harness, device: Device, event_json: dict[str, Any]) -> Event:
    event = Event.from_json(event_json)
    await harness.enqueue([device], event)
    return event


def _in_clear(harness: Harness, phone: Phone, event: Event) -> list[str]:
    """What must never be readable outside `sealed`: ids, keys, npubs, the relay."""
    recipient, sender = harness.recipient_key.public_key_hex, harness.sender_key.public_key_hex
    return [event.id, event.pubkey, recipient, sender, encode_npub(recipient), encode_npub(sender),
            RELAY, RELAY.removeprefix("wss://"), phone.device_key.public_key_hex,
            phone.device_key.secret_hex]


def _apns_to(fake_apns: FakeApns, token: str) -> list[ApnsRequest]:
    return [r for r in fake_apns.requests if r.token == token]


def _assert_nothing_in_clear(wire: str, harness: Harness, phone: Phone, events: list[Event]) -> None:
    for event in events:
        for secret in _in_clear(harness, phone, event):
            assert secret not in wire, f"{secret[:12]}… in clear"


async def test_apns_carries_the_dm_sealed_to_the_device_and_nothing_in_clear(
    make_harness: Any, fake_apns: FakeApns
) -> None:
    """A NIP-17 gift wrap: the body is the alert (mutable-content 1) plus `sealed` and `epk`
    only; nostr-sdk decrypts it with the device secret to the wrap exactly as received, which
    verifies and unwraps with the account's key to the text sent. No byte of the body or the
    headers names the event, a key or the relay; the collapse id is not the event id."""
    harness = await make_harness()
    phone, token = Phone(harness), apns_token()
    device = await _register(harness, phone, "ios", token)
    wrap_json = gift_wrap(phone.sender, phone.account, "see you at the station at nine")
    event = await _enqueue(harness, device, wrap_json)

    [request] = await eventually(lambda: _apns_to(fake_apns, token), what="the sealed push")
    await eventually(harness.drained, what="outbox drained")

    assert set(request.body) == {"aps", "sealed", "epk"}
    assert request.body["aps"] == APS and request.body["aps"]["mutable-content"] == 1
    assert len(request.raw_body) <= MAX_PAYLOAD_BYTES
    assert phone.open(request.body) == {"v": 1, "event": wrap_json, "relay": RELAY}
    assert phone.read(request.body) == (phone.sender.public_key().to_hex(),
                                        "see you at the station at nine")
    wire = json.dumps(request.headers) + request.raw_body.decode()
    _assert_nothing_in_clear(wire, harness, phone, [event])
    assert event.id[:16] not in request.headers["apns-collapse-id"]
    assert request.headers["apns-push-type"] == "alert"
    records = await eventually(harness.push_records)
    assert [(r["event_id"], r["status"]) for r in records] == [(event.id, "accepted")]


async def test_a_kind_4_dm_opens_to_its_text(make_harness: Any, fake_apns: FakeApns) -> None:
    harness = await make_harness()
    phone, token = Phone(harness), apns_token()
    device = await _register(harness, phone, "ios", token)
    await _enqueue(harness, device, kind4_dm(phone.sender, phone.account, "old school"))

    [request] = await eventually(lambda: _apns_to(fake_apns, token), what="the sealed push")
    assert phone.read(request.body) == (phone.sender.public_key().to_hex(), "old school")


async def test_every_push_has_its_own_ephemeral_key(make_harness: Any, fake_apns: FakeApns) -> None:
    """Five DMs, five pushes (sealed wakeups are never coalesced), five different `epk`s, none
    of them the device key; each opens to its own event."""
    harness = await make_harness(limits={"coalesce_window_ms": 60_000})
    phone, token = Phone(harness), apns_token()
    device = await _register(harness, phone, "ios", token)
    events = [await _enqueue(harness, device, kind4_dm(phone.sender, phone.account, f"dm {n}"))
              for n in range(5)]

    requests = await eventually(lambda: len(_apns_to(fake_apns, token)) == 5 and
                                _apns_to(fake_apns, token), what="five sealed pushes")
    epks = {r.body["epk"] for r in requests}
    assert len(epks) == 5 and phone.device_key.public_key_hex not in epks
    assert sorted(phone.open(r.body)["event"]["id"] for r in requests) == sorted(e.id for e in events)


async def test_an_event_over_the_limit_is_sealed_as_a_pointer(
    make_harness: Any, fake_apns: FakeApns, fake_fcm: FakeFcm
) -> None:
    """A gift wrap too big for 4,096 bytes: APNs and FCM pushes carry the sealed pointer (id,
    kind, relay), stay within 4,096 bytes, and still say nothing in clear."""
    harness = await make_harness()
    phone = Phone(harness)
    ios, android = apns_token(), fcm_token()
    devices = [await _register(harness, phone, "ios", ios),
               await _register(harness, phone, "android", android)]
    wrap_json = gift_wrap(phone.sender, phone.account, "long letter " * 300)
    event = Event.from_json(wrap_json)
    await harness.enqueue(devices, event)

    [apns] = await eventually(lambda: _apns_to(fake_apns, ios), what="the APNs push")
    [fcm] = await eventually(lambda: [m for m in fake_fcm.messages if m["token"] == android],
                             what="the FCM push")
    pointer = {"v": 1, "id": event.id, "kind": 1059, "relay": RELAY}
    assert phone.open(apns.body) == pointer
    assert phone.open(fcm["data"]) == pointer
    assert len(apns.raw_body) <= MAX_PAYLOAD_BYTES
    assert sum(len(k.encode()) + len(v.encode()) for k, v in fcm["data"].items()) <= MAX_PAYLOAD_BYTES
    wire = json.dumps(apns.headers) + apns.raw_body.decode() + json.dumps(fcm)
    _assert_nothing_in_clear(wire, harness, phone, [event])


async def test_fcm_sends_exactly_type_sealed_and_epk(make_harness: Any, fake_fcm: FakeFcm) -> None:
    """Data-only, high priority, no collapse key, data exactly `type`, `sealed`, `epk`; the
    whole HTTP request (headers and body) names neither the event nor a key nor the relay."""
    harness = await make_harness()
    phone, token = Phone(harness), fcm_token()
    device = await _register(harness, phone, "android", token)
    wrap_json = gift_wrap(phone.sender, phone.account, "android says hi")
    event = await _enqueue(harness, device, wrap_json)

    [message] = await eventually(lambda: [m for m in fake_fcm.messages if m["token"] == token],
                                 what="the FCM push")
    assert set(message["data"]) == {"type", "sealed", "epk"}
    assert message["data"]["type"] == "wakeup"
    assert "notification" not in message
    assert message["android"]["priority"] == "high" and "collapse_key" not in message["android"]
    assert phone.read(message["data"]) == (phone.sender.public_key().to_hex(), "android says hi")
    [(headers, body)] = [(h, b) for h, b in fake_fcm.requests if token.encode() in b]
    _assert_nothing_in_clear(json.dumps(headers) + body.decode(), harness, phone, [event])


async def test_unifiedpush_carries_the_same_json_inside_rfc_8291(
    make_harness: Any, fake_up: FakeUnifiedPush
) -> None:
    """http_ece decrypts the body to `{"type", "sealed", "epk"}`, which opens like FCM's data;
    no Topic (a sealed push is not interchangeable with another)."""
    harness = await make_harness()
    phone, subscriber = Phone(harness), WebPushSubscriber.generate()
    device = await _register(harness, phone, "unifiedpush", fake_up.endpoint("sealed"),
                             WebPushKeys(subscriber.p256dh, subscriber.auth))
    event = await _enqueue(harness, device, gift_wrap(phone.sender, phone.account, "via ntfy"))

    [request] = await eventually(lambda: fake_up.received("sealed"), what="the UnifiedPush push")
    data = json.loads(subscriber.decrypt(request.body))
    assert set(data) == {"type", "sealed", "epk"}
    assert phone.read(data) == (phone.sender.public_key().to_hex(), "via ntfy")
    assert "topic" not in request.headers and len(request.body) <= MAX_PAYLOAD_BYTES
    _assert_nothing_in_clear(json.dumps(request.headers) + request.body.hex(), harness, phone,
                             [event])


async def test_beyond_the_rate_limit_the_excess_is_one_opaque_wakeup(
    make_harness: Any, fake_apns: FakeApns
) -> None:
    """Two pushes a minute allowed, three sealed DMs due together: one goes sealed, the other
    two ride in one opaque wakeup (nothing dropped, every event recorded as accepted)."""
    harness = await make_harness(start=False, limits={"wakeups_per_minute_per_device": 2})
    phone, token = Phone(harness), apns_token()
    device = await _register(harness, phone, "ios", token)
    events = [await _enqueue(harness, device, kind4_dm(phone.sender, phone.account, f"dm {n}"))
              for n in range(3)]
    await harness.start()

    requests = await eventually(lambda: len(_apns_to(fake_apns, token)) == 2 and
                                _apns_to(fake_apns, token), what="two pushes")
    await eventually(harness.drained, what="outbox drained")
    sealed = [r for r in requests if "sealed" in r.body]
    opaque = [r for r in requests if "sealed" not in r.body]
    assert len(sealed) == 1 and [r.body for r in opaque] == [{"aps": APS}]
    assert phone.open(sealed[0].body)["event"]["id"] in {e.id for e in events}
    records = await eventually(lambda: len(harness.push_records()) == 3 and harness.push_records())
    assert sorted(r["event_id"] for r in records) == sorted(e.id for e in events)
    assert {r["status"] for r in records} == {"accepted"}


async def test_the_example_script_opens_a_captured_push(
    make_harness: Any, fake_apns: FakeApns, tmp_path: Path
) -> None:
    """docs/examples/decrypt_sealed_push.py as a reader runs it, on a push saved from APNs."""
    harness = await make_harness()
    phone, token = Phone(harness), apns_token()
    device = await _register(harness, phone, "ios", token)
    await _enqueue(harness, device, gift_wrap(phone.sender, phone.account, "from the docs"))
    [request] = await eventually(lambda: _apns_to(fake_apns, token), what="the sealed push")
    captured = tmp_path / "push.json"
    captured.write_bytes(request.raw_body)

    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(EXAMPLE_PATH), str(captured), phone.device_key.secret_hex,
         phone.account.secret_key().to_hex()],
        capture_output=True, text=True, timeout=scaled(COMMAND_SECONDS), check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "from": phone.sender.public_key().to_hex(), "text": "from the docs", "relay": RELAY,
    }


def test_the_whole_event_goes_whenever_it_fits_and_never_beyond_4096_bytes() -> None:
    """Across event sizes from small to well past the limit, per provider's measure: the sealed
    push is within 4,096 bytes, and it carries the whole event exactly when that push would
    fit (else the pointer). Opened with nostr-sdk, not our code."""
    device = SecretKey.generate()
    recipient = SecretKey.generate().public_key_hex
    measures = {"apns": apns_size, "fcm": fcm_size, "unifiedpush": unifiedpush_size}
    for provider, size in measures.items():
        kinds_seen = set()
        for length in range(1000, 4200, 97):
            event = sign_event(SecretKey.generate(), 1059, "x" * length, [["p", recipient]])
            event_json = json.dumps(event.to_json(), separators=(",", ":"))
            data = sealed_data(device.public_key_hex, event.id, RELAY, event_json,
                               lambda d, size=size: size(d) <= MAX_PAYLOAD_BYTES)
            assert size(data) <= MAX_PAYLOAD_BYTES, (provider, length)
            opened = example.open_sealed(data, device.secret_hex)
            whole = {"v": 1, "event": event.to_json(), "relay": RELAY}
            whole_size = size({"type": "wakeup", "epk": "0" * 64, "sealed": "A" * nip44.payload_length(
                len(json.dumps(whole, separators=(",", ":")).encode()))})
            expected = whole if whole_size <= MAX_PAYLOAD_BYTES else {
                "v": 1, "id": event.id, "kind": 1059, "relay": RELAY}
            assert opened == expected, (provider, length)
            kinds_seen.add("event" in opened)
        assert kinds_seen == {True, False}, provider


async def test_from_relay_frame_to_sealed_push_in_process(
    tmp_path: Path, engine: Any, credentials: Any, fake_apns: FakeApns,
    fake_fcm_server: Any,
) -> None:
    """The whole path in one process: a relay's EVENT frame with a NIP-17 gift wrap reaches the
    bridge (firehose, no relay process), the committer queues it for the sealed registration
    with the event itself, and the real Delivery seals it to APNs, where nostr-sdk opens it to
    the text sent."""
    relay = "ws://127.0.0.1:9"  # nothing listens: the frame is fed to the bridge directly
    async with in_process_bridge(
        tmp_path, engine.database("push.db"), [{"url": relay, "mode": "firehose"}]
    ) as parts:
        account, sender = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
        me, device_key, token = account.public_key().to_hex(), SecretKey.generate(), apns_token()
        await parts.devices.register(me, "ios", token, "sealed", (), None, 0,
                                     device_key=device_key.public_key_hex)
        await eventually(lambda: me in parts.bridge._pool.subs[relay].keys, what="key watched")
        # a firehose still catching up wakes only devices registered by the event's created_at,
        # and gift wraps are back-dated by up to two days: the registration is made older
        await parts.db.execute(
            "UPDATE devices SET registered_at = registered_at - ? WHERE pubkey = ?",
            (3 * 24 * 3600, me),
        )
        wrap_json = gift_wrap(sender, account, "straight from the relay")
        frame = json.dumps(["EVENT", "sp0.1", wrap_json], separators=(",", ":"))
        assert parts.bridge.pool.deliver_text(relay, frame, time.time_ns() // 1_000_000)
        await eventually(parts.outbox.depth, what="the wakeup queued")

        config = parse_config(
            document(provider_tables(credentials, fake_apns, fake_fcm_server)),
            tmp_path / "relays.toml",
            TABLES,
        )
        delivery = Delivery(parts.outbox, parts.devices, await build_senders(config),
                            parts.observations, True, config.push, config.limits)
        await delivery.start()
        try:
            [request] = await eventually(lambda: _apns_to(fake_apns, token), what="the push")
        finally:
            await delivery.stop()
    opened = example.open_sealed(request.body, device_key.secret_hex)
    assert opened == {"v": 1, "event": wrap_json, "relay": relay}
    event = example.verified_event(opened)
    assert example.read_message(event, account.secret_key().to_hex())[1] == "straight from the relay"
    assert set(request.body) == {"aps", "sealed", "epk"}


def test_planning_never_coalesces_sealed_wakeups() -> None:
    """The pure planning step: a phone with an opaque account and a sealed one, inside the
    coalescing window after an opaque push. Each sealed wakeup goes at once as its own push
    carrying exactly type/sealed/epk, while the opaque one waits for the window; a sealed row
    queued before its registration asked for `sealed` (no event kept) goes as a plain wakeup."""
    phone, device_key = "ab" * 32, SecretKey.generate()
    opaque = Device(1, "1" * 64, "ios", phone, "opaque", (), None, 0)
    sealed = Device(2, "2" * 64, "ios", phone, "sealed", (), None, 0, device_key.public_key_hex)
    policies = {"ios": PlatformPolicy("apns", lambda d: apns_size(d) <= MAX_PAYLOAD_BYTES, None)}
    plans = Planner(policies, PushConfig(), LimitsConfig(coalesce_window_ms=30_000,
                                                         wakeups_per_minute_per_device=0),
                    lambda wakeup_id: f"collapse-{wakeup_id}")
    now = 1_800_000_000_000
    event_json = json.dumps(kind4_dm(nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate(), "hi"))
    plans.plan([Wakeup(1, opaque, "e" * 64, RELAY, None, now, 0)], now, {})

    waiting = Wakeup(2, opaque, "f" * 64, RELAY, None, now, 0)
    first = Wakeup(3, sealed, json.loads(event_json)["id"], RELAY, event_json, now, 0)
    second = Wakeup(4, sealed, json.loads(event_json)["id"], RELAY, event_json, now, 0)
    queued_before = Wakeup(5, sealed, "9" * 64, RELAY, None, now, 0)
    plan = plans.plan([waiting, first, second, queued_before], now + 1_000, {})

    assert sorted([w.id for w in p.wakeups] for p in plan.pushes) == [[3], [4], [5]]
    assert plan.held == {now + 30_000: [waiting.id]}
    by_row = {p.wakeups[0].id: p.message.data for p in plan.pushes}
    assert set(by_row[3]) == set(by_row[4]) == {"type", "sealed", "epk"}
    assert by_row[3]["epk"] != by_row[4]["epk"]
    assert example.open_sealed(by_row[3], device_key.secret_hex)["event"] == json.loads(event_json)
    assert by_row[5] == {"type": "wakeup"}
