"""The delivery loop's promises: coalescing, per-device limits, payload modes and their size
fallback, stale drops, resume after a crash, dry-run, and that no push carries a key or content."""

from __future__ import annotations

import json
import logging

from sigil_push.nostr.nip19 import encode_npub
from sigil_push.observations import now_ms
from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.fake_fcm import FakeFcm
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush
from testkit.fakes.harness import (
    RELAY,
    apns_token,
    eventually,
    fcm_token,
)


def _to(fake: FakeApns, token: str) -> list:
    return [r for r in fake.requests if r.token == token]


async def test_opaque_wakeups_within_the_window_become_one_push(make_harness, fake_apns: FakeApns) -> None:
    """Five events at once make one push; three more inside the window make one more, after it."""
    harness = await make_harness(limits={"coalesce_window_ms": 2000}, start=False)
    token = apns_token()
    device = await harness.register("ios", token)
    first = [await harness.enqueue([device]) for _ in range(5)]
    await harness.start()

    await eventually(lambda: _to(fake_apns, token), what="the first push")
    second = [await harness.enqueue([device]) for _ in range(3)]
    await eventually(lambda: len(harness.push_records()) == 8, what="eight push records")
    await eventually(harness.drained)

    assert len(_to(fake_apns, token)) == 2
    records = harness.push_records()
    assert {r["event_id"] for r in records} == {e.id for e in first + second}
    assert {r["status"] for r in records} == {"accepted"}
    assert len({r["ts"] for r in records[:5]}) == 1, "one answer for the five coalesced events"


async def test_the_per_device_rate_limit_coalesces_the_excess(make_harness, fake_fcm: FakeFcm) -> None:
    """event_id mode sends one push per event, up to the device's budget; the excess rides along
    in one opaque push, so nothing is dropped and the budget holds."""
    harness = await make_harness(limits={"wakeups_per_minute_per_device": 3}, start=False)
    token = fcm_token()
    device = await harness.register("android", token, payload="event_id")
    events = [await harness.enqueue([device]) for _ in range(10)]
    await harness.start()

    await eventually(lambda: len(harness.push_records()) == 10, what="ten push records")
    await eventually(harness.drained)
    messages = [m for m in fake_fcm.messages if m["token"] == token]
    assert len(messages) == 3
    singles = [m["data"]["event_id"] for m in messages if "event_id" in m["data"]]
    assert singles == [events[0].id, events[1].id]
    assert [m["data"] for m in messages if "event_id" not in m["data"]] == [{"type": "wakeup"}]
    assert {r["event_id"] for r in harness.push_records()} == {e.id for e in events}


async def test_a_device_over_its_budget_waits_and_then_gets_one_push(make_harness, fake_apns: FakeApns) -> None:
    """With the budget spent, later wakeups are held in the outbox, not dropped."""
    harness = await make_harness(limits={"wakeups_per_minute_per_device": 1})
    token = apns_token()
    device = await harness.register("ios", token)
    await harness.enqueue([device])
    await eventually(lambda: len(_to(fake_apns, token)) == 1)
    await harness.enqueue([device])
    await harness.enqueue([device])

    rows = await eventually(lambda: _held(harness), what="held wakeups")
    assert len(rows) == 2
    assert all(row[4] >= now_ms() + 30_000 for row in rows), "held until a token is back (60 s/1)"
    assert len(_to(fake_apns, token)) == 1


async def _held(harness):
    rows = await harness.outbox_rows()
    return rows if len(rows) == 2 and all(row[5] is None and row[4] > now_ms() for row in rows) else None


async def test_payload_modes_carry_what_the_contract_says(make_harness, fake_apns: FakeApns) -> None:
    harness = await make_harness()
    opaque, by_id, full = apns_token(), apns_token(), apns_token()
    devices = [
        await harness.register("ios", opaque),
        await harness.register("ios", by_id, payload="event_id"),
        await harness.register("ios", full, payload="event"),
    ]
    event = await harness.enqueue(devices)

    await eventually(lambda: all(_to(fake_apns, t) for t in (opaque, by_id, full)))
    bodies = {t: _to(fake_apns, t)[0].body for t in (opaque, by_id, full)}
    assert set(bodies[opaque]) == {"aps"}
    assert {k: v for k, v in bodies[by_id].items() if k != "aps"} == {"event_id": event.id, "relay": RELAY}
    assert set(bodies[full]) == {"aps", "event"}
    assert json.loads(bodies[full]["event"]) == event.to_json()


async def test_an_event_too_big_for_the_provider_falls_back_to_its_id(make_harness, fake_apns: FakeApns, fake_fcm: FakeFcm, fake_up: FakeUnifiedPush) -> None:
    """Over 4 KiB the `event` mode sends `event_id` + `relay` instead, on every provider."""
    harness = await make_harness()
    ios, android = apns_token(), fcm_token()
    devices = [
        await harness.register("ios", ios, payload="event"),
        await harness.register("android", android, payload="event"),
        await harness.register("unifiedpush", fake_up.endpoint("big"), payload="event"),
    ]
    big = await harness.enqueue(devices, harness.event("x" * 5000, kind=1059))
    small = await harness.enqueue(devices, harness.event("y" * 100, kind=1059))

    await eventually(lambda: len(harness.push_records()) == 6)
    expected = {"event_id": big.id, "relay": RELAY}
    # a device's two wakeups may reach its provider in either order (PostgreSQL's claims
    # run on concurrent connections), so each is told apart by its form, not its place
    apns_bodies = [{k: v for k, v in r.body.items() if k != "aps"} for r in _to(fake_apns, ios)]
    fcm_data = [m["data"] for m in fake_fcm.messages if m["token"] == android]
    up_bodies = [json.loads(r.body) for r in fake_up.received("big")]
    for bodies, wakeup in ((apns_bodies, {}), (fcm_data, {"type": "wakeup"}),
                           (up_bodies, {"type": "wakeup"})):
        pointers = [body for body in bodies if "event" not in body]
        full = [json.loads(body["event"])["id"] for body in bodies if "event" in body]
        assert pointers == [{**wakeup, **expected}]
        assert full == [small.id]
    assert {r["status"] for r in harness.push_records()} == {"accepted"}


async def test_no_push_carries_a_key_or_the_content(make_harness, fake_apns: FakeApns, fake_fcm: FakeFcm, fake_up: FakeUnifiedPush, caplog) -> None:
    """Opaque and event_id wakeups: the provider sees neither the content, nor the sender's or
    recipient's key (hex or npub), in the body or any header; nor do our logs."""
    caplog.set_level(logging.DEBUG)
    harness = await make_harness()
    ios = [apns_token(), apns_token()]
    android = [fcm_token(), fcm_token()]
    devices = []
    for mode, i in (("opaque", 0), ("event_id", 1)):
        devices.append(await harness.register("ios", ios[i], payload=mode))
        devices.append(await harness.register("android", android[i], payload=mode))
        devices.append(await harness.register("unifiedpush", fake_up.endpoint(f"leak-{mode}"), payload=mode))
    content = "meet me at the old mill at noon"
    await harness.enqueue(devices, harness.event(content))

    await eventually(lambda: len(harness.push_records()) == 6)
    secrets = [content, harness.sender_key.public_key_hex, harness.recipient_key.public_key_hex,
               encode_npub(harness.sender_key.public_key_hex),
               encode_npub(harness.recipient_key.public_key_hex)]
    seen = []
    for token in ios:
        seen += [json.dumps(r.headers) + r.raw_body.decode() for r in _to(fake_apns, token)]
    seen += [json.dumps(h) + b.decode() for h, b in fake_fcm.requests if any(t in b.decode() for t in android)]
    seen += [json.dumps(r.headers) + r.body.decode() for r in fake_up.requests if r.name.startswith("leak-")]
    assert len(seen) == 6
    # aiosqlite's own DEBUG lines echo SQL parameters; that is the logging setup's concern
    logged = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith("aiosqlite"))
    for text in [*seen, logged]:
        for secret in secrets:
            assert secret not in text
    for token in ios + android:
        assert token not in logged


async def test_a_burst_of_answers_is_recorded_once_per_wakeup_without_keys_or_content(
    make_harness, fake_apns: FakeApns
) -> None:
    """Accepted pushes are counted and logged per answer burst, not per push: still one record
    per wakeup with only the record's fields (no content, no sender or recipient key in any
    form, no token), one latency observation and one counted outcome per push."""
    from prometheus_client import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"provider": "apns", **labels}) or 0.0

    accepted_before = sample("sigil_push_pushes_total", outcome="accepted")
    observed_before = sample("sigil_push_push_latency_seconds_count")
    harness = await make_harness(start=False)
    tokens = [apns_token() for _ in range(30)]
    devices = [await harness.register("ios", token, payload="event_id") for token in tokens]
    content = "meet me at the old mill at noon"
    events = [await harness.enqueue([device], harness.event(f"{content} {i}"))
              for i, device in enumerate(devices)]
    await harness.start()

    await eventually(harness.drained, what="outbox drained")
    records = await eventually(lambda: len(harness.push_records()) == 30 and harness.push_records())
    assert sorted(r["event_id"] for r in records) == sorted(e.id for e in events)
    assert all(set(r) == {"type", "ts", "event_id", "platform", "status", "latency_ms"}
               and (r["platform"], r["status"]) == ("ios", "accepted") for r in records)
    logged = "\n".join(p.read_text() for p in (harness.folder / "observations").glob("*.jsonl"))
    for secret in [content, harness.sender_key.public_key_hex, harness.recipient_key.public_key_hex,
                   encode_npub(harness.sender_key.public_key_hex),
                   encode_npub(harness.recipient_key.public_key_hex), *tokens]:
        assert secret not in logged
    assert sample("sigil_push_pushes_total", outcome="accepted") - accepted_before == 30
    assert sample("sigil_push_push_latency_seconds_count") - observed_before == 30


async def test_stale_wakeups_are_dropped_as_failed(make_harness, fake_apns: FakeApns) -> None:
    harness = await make_harness(push={"max_wakeup_age_seconds": 60})
    token = apns_token()
    device = await harness.register("ios", token)
    event = await harness.enqueue([device], first_seen_ms=now_ms() - 61_000)

    records = await eventually(harness.push_records)
    assert [(r["event_id"], r["status"]) for r in records] == [(event.id, "failed")]
    await eventually(harness.drained)
    assert _to(fake_apns, token) == []


async def test_retries_stop_after_max_attempts(make_harness, fake_apns: FakeApns) -> None:
    harness = await make_harness(push={"max_attempts": 3})
    token = apns_token()
    fake_apns.script.answers[token] = (503, "ServiceUnavailable")
    await harness.enqueue([await harness.register("ios", token)])

    await eventually(lambda: [r for r in harness.push_records() if r["status"] == "failed"])
    await eventually(harness.drained)
    assert [r["status"] for r in harness.push_records()] == ["retry", "retry", "retry", "failed"]
    assert len(_to(fake_apns, token)) == 3


async def test_wakeups_in_flight_at_a_crash_are_resent_at_start_with_the_same_collapse_id(
    make_harness, fake_apns: FakeApns
) -> None:
    """A claimed row (sent, answer never recorded) goes out again after a restart; APNs gets the
    same apns-collapse-id, so a notification that did arrive is replaced, not doubled."""
    harness = await make_harness(start=False)
    token = apns_token()
    device = await harness.register("ios", token)
    await harness.enqueue([device])
    await harness.outbox.resume(now_ms())
    wakeup = (await harness.outbox.due(now_ms(), 10))[0]
    collapse_id = harness.outbox.collapse_id(wakeup.id)

    await harness.start()

    request = (await eventually(lambda: _to(fake_apns, token)))[0]
    assert request.headers["apns-collapse-id"] == collapse_id
    await eventually(harness.drained)


async def test_dry_run_logs_one_line_per_push_and_records_nothing(make_harness, caplog) -> None:
    """The line has the token suffix and the number of events, never an event id (README)."""
    caplog.set_level(logging.INFO, logger="sigil_push.push.dryrun")
    harness = await make_harness(providers={})
    token = apns_token()
    device = await harness.register("ios", token)
    event = await harness.enqueue([device])

    await eventually(harness.drained)
    lines = [r.getMessage() for r in caplog.records if r.name == "sigil_push.push.dryrun"]
    assert lines == [f"dry-run wakeup platform=ios token=…{token[-6:]} events=1"]
    assert event.id not in caplog.text
    await harness.observations.stop()
    await harness.observations.start()
    assert harness.push_records() == []


def test_collapse_ids_are_the_keyed_hmac_of_the_row_id() -> None:
    """The keyed state is reused across pushes, but every id is still HMAC-SHA256(secret, row
    id) cut to 32 hex digits: stable across restarts and versions, different per secret."""
    import hashlib
    import hmac

    from sigil_push.store.records import collapse_id

    secrets = [bytes([n]) * 32 for n in range(12)]  # more secrets than are kept keyed
    secrets += [b"k" * 64, b"l" * 65, b"m"]  # HMAC's key at, above and below its block size
    for wakeup_id in (1, 2, 987654321):
        for secret in secrets:
            expected = hmac.digest(secret, str(wakeup_id).encode(), hashlib.sha256).hex()[:32]
            assert collapse_id(secret, wakeup_id) == expected
    assert len({collapse_id(secret, 7) for secret in secrets}) == len(secrets)
