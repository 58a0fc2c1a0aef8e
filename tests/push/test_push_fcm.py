"""FCM delivery: unmodified firebase-admin (async API, real OAuth flow) against a local FCM v1."""

from __future__ import annotations

import json

from sigil_push.observations import now_ms
from testkit.fakes.fake_fcm import FakeFcm
from testkit.fakes.harness import (
    eventually,
    fcm_token,
)


def _messages(fake: FakeFcm, token: str) -> list[dict]:
    return [m for m in fake.messages if m["token"] == token]


def _attempts(fake: FakeFcm, token: str) -> int:
    return sum(1 for _, body in fake.requests if json.loads(body)["message"]["token"] == token)


async def test_a_wakeup_is_a_high_priority_data_only_message(make_harness, fake_fcm: FakeFcm) -> None:
    """Opaque wakeups: data {"type": "wakeup"} only, android.priority high, a TTL and a collapse key,
    sent with an access token obtained from the service account's token_uri."""
    harness = await make_harness()
    token = fcm_token()
    device = await harness.register("android", token)
    event = await harness.enqueue([device])

    message = (await eventually(lambda: _messages(fake_fcm, token)))[0]
    assert message["data"] == {"type": "wakeup"}
    assert "notification" not in message
    assert message["android"]["priority"] == "high"
    assert message["android"]["collapse_key"] == "wakeup"
    ttl = float(message["android"]["ttl"].removesuffix("s"))
    assert 3500 < ttl <= 3600
    assert fake_fcm.token_requests >= 1
    await eventually(harness.drained)
    records = await eventually(harness.push_records)
    assert [(r["event_id"], r["platform"], r["status"]) for r in records] == [(event.id, "android", "accepted")]


async def test_event_id_mode_sends_the_id_and_relay_without_a_collapse_key(make_harness, fake_fcm: FakeFcm) -> None:
    harness = await make_harness()
    token = fcm_token()
    device = await harness.register("android", token, payload="event_id")
    event = await harness.enqueue([device])

    message = (await eventually(lambda: _messages(fake_fcm, token)))[0]
    assert message["data"] == {"type": "wakeup", "event_id": event.id, "relay": "wss://relay.example.com"}
    assert "collapse_key" not in message["android"]


async def test_unregistered_and_invalid_tokens_are_pruned(make_harness, fake_fcm: FakeFcm) -> None:
    """404 UNREGISTERED and 400 'not a valid FCM registration token' forget the device."""
    harness = await make_harness()
    gone, invalid = fcm_token(), fcm_token()
    fake_fcm.script.answers[gone] = ("UNREGISTERED", None)
    fake_fcm.script.answers[invalid] = ("INVALID_TOKEN", None)
    devices = [await harness.register("android", gone), await harness.register("android", invalid)]
    await harness.enqueue(devices)

    await eventually(harness.forgotten, what="devices forgotten")
    await eventually(harness.drained)
    # both records written (the observation log is written behind the outbox: one record
    # could be on disk while the other was not, in a paired run)
    await eventually(lambda: len(harness.push_records()) >= 2, what="two push records")
    assert sorted(r["status"] for r in harness.push_records()) == ["unregistered"] * 2


async def test_quota_exceeded_waits_for_retry_after(make_harness, fake_fcm: FakeFcm) -> None:
    """429 with Retry-After: the wakeup stays in the outbox and is not due before Retry-After."""
    harness = await make_harness()
    token = fcm_token()
    fake_fcm.script.answers[token] = ("QUOTA_EXCEEDED", "30")
    device = await harness.register("android", token)
    await harness.enqueue([device])

    await eventually(lambda: [r for r in harness.push_records() if r["status"] == "retry"])
    answered = harness.push_records()[0]["ts"]
    rows = await eventually(lambda: _released(harness), what="rescheduled")
    assert rows[0][4] >= answered + 30_000 - 100  # the record is stamped just after the answer
    assert _attempts(fake_fcm, token) == 1


async def _released(harness):
    rows = await harness.outbox_rows()
    return rows if rows and rows[0][5] is None else None


async def test_server_errors_are_retried_by_us_not_by_firebase_admin(make_harness, fake_fcm: FakeFcm) -> None:
    """503 is one HTTP request per attempt (firebase-admin's own retries are off), then accepted."""
    harness = await make_harness(push={"retry_base_seconds": 0.5, "retry_max_seconds": 0.5})
    token = fcm_token()
    fake_fcm.script.answers[token] = ("UNAVAILABLE", None)
    device = await harness.register("android", token)
    await harness.enqueue([device])

    await eventually(lambda: [r for r in harness.push_records() if r["status"] == "retry"])
    assert _attempts(fake_fcm, token) == 1
    del fake_fcm.script.answers[token]
    await eventually(harness.drained, what="delivered after recovery")
    await eventually(lambda: [r["status"] for r in harness.push_records()][-1:] == ["accepted"])


async def test_invalid_argument_is_rejected(make_harness, fake_fcm: FakeFcm) -> None:
    harness = await make_harness()
    token = fcm_token()
    fake_fcm.script.answers[token] = ("INVALID_ARGUMENT", None)
    device = await harness.register("android", token)
    await harness.enqueue([device])

    records = await eventually(harness.push_records)
    assert [r["status"] for r in records] == ["rejected"]
    await eventually(harness.drained)
    assert await harness.devices.count() == 1


async def test_latency_is_measured_from_first_seen(make_harness, fake_fcm: FakeFcm) -> None:
    harness = await make_harness()
    device = await harness.register("android", fcm_token())
    await harness.enqueue([device], first_seen_ms=now_ms() - 5_000)

    record = (await eventually(harness.push_records))[0]
    assert 5_000 <= record["latency_ms"] < 60_000
