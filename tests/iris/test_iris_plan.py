"""Planning an Iris target's push (pure, as tests/delivery/test_delivery_plan.py): Web Push and
webhook targets get the event and its relay for their sender to build the body; APNs and FCM
targets get generic keys (the event only for ciphertext kinds, and only when it fits); each
target's budget is a burst of 20, then one push per 6 s, and the excess is suppressed."""

from __future__ import annotations

import dataclasses
import json

import nostr_sdk

from sigil_push.config import LimitsConfig, PushConfig
from sigil_push.delivery.plan import Planner, PlatformPolicy, endpoint_caps, platform_policies
from sigil_push.push.apns_sender import apns_size
from sigil_push.push.fcm_sender import fcm_size
from sigil_push.push.payload import MAX_PAYLOAD_BYTES
from sigil_push.store.records import Device, Wakeup, WebPushKeys

NOW = 1_800_000_000_000
RELAY = "wss://relay.example.com"
URL = "https://iris.example/"
POLICIES = {
    "webpush": PlatformPolicy("webpush", lambda d: True, None),
    "webhook": PlatformPolicy("webhook", lambda d: True, None),
    "ios": PlatformPolicy("apns", lambda d: apns_size(d) <= MAX_PAYLOAD_BYTES, None),
    "android": PlatformPolicy("fcm", lambda d: fcm_size(d) <= MAX_PAYLOAD_BYTES, None),
}


def event(kind: int, content: str) -> str:
    built = nostr_sdk.EventBuilder(nostr_sdk.Kind(kind), content).tags(
        [nostr_sdk.Tag.parse(["p", "b" * 64])]
    ).finalize(nostr_sdk.Keys.generate())
    return str(built.as_json())


def wakeup(platform: str, event_json: str, number: int = 1) -> Wakeup:
    keys = WebPushKeys("B" * 87, "A" * 22) if platform == "webpush" else None
    device = Device(1, "b" * 64, platform, "target", "iris", (), keys, 0)
    return Wakeup(number, device, json.loads(event_json)["id"], RELAY, event_json, NOW, 0)


def planner() -> Planner:
    limits = LimitsConfig(wakeups_per_minute_per_device=1, coalesce_window_ms=60_000)
    return Planner(POLICIES, PushConfig(), limits, lambda n: f"c{n}", URL)


def plan(platform: str, event_json: str) -> dict[str, str]:
    [push] = planner().plan([wakeup(platform, event_json)], NOW, {}).pushes
    assert not push.message.opaque
    return push.message.data


def test_web_push_and_webhook_targets_get_the_event_and_its_relay() -> None:
    note = event(1, "hello")
    for platform in ("webpush", "webhook"):
        assert plan(platform, note) == {"event": note, "relay": RELAY}


def test_apns_and_fcm_targets_get_generic_keys_and_the_event_of_ciphertext_kinds_only() -> None:
    note = event(1, "public words")
    for platform in ("ios", "android"):
        data = plan(platform, note)
        assert set(data) == {"title", "body", "url"}
        assert data["title"] == "Mention" and data["body"] == ""
        assert "public words" not in json.dumps(data) and RELAY not in json.dumps(data)
    dm = event(1059, "wrapped")
    data = plan("android", dm)
    assert json.loads(data["event"]) == json.loads(dm) and data["title"] == "DM"
    too_big = event(1059, "w" * 4000)
    assert set(plan("ios", too_big)) == {"title", "body", "url"}, "dropped, not truncated"


def test_a_target_gets_a_burst_of_20_then_one_push_per_6_seconds_and_the_rest_is_suppressed() -> None:
    """The phones' own rate limit (1 a minute here) and coalescing window do not apply."""
    planner_ = planner()
    note = event(1, "hello")
    burst = [wakeup("webpush", note, n) for n in range(25)]
    first = planner_.plan(list(reversed(burst)), NOW, {})
    assert [p.wakeups[0].id for p in first.pushes] == list(range(20)), "oldest first, one each"
    assert [w.id for w in first.rate_limited] == [20, 21, 22, 23, 24]
    assert first.held == {}
    assert planner_.plan([burst[0]], NOW + 5_999, {}).rate_limited == [burst[0]]
    later = planner_.plan(burst[:2], NOW + 6_000, {})
    assert len(later.pushes) == 1 and later.rate_limited == [burst[1]]
    other = wakeup("webpush", note)._replace(
        device=dataclasses.replace(burst[0].device, id=2, token="another endpoint")
    )
    assert len(planner_.plan([other], NOW + 6_000, {}).pushes) == 1, "another target's own budget"
    planner_.prune(NOW + 6_000 + 20 * 6_000)
    refilled = planner_.plan(burst[:20], NOW + 6_000 + 20 * 6_000, {})
    assert len(refilled.pushes) == 20 and refilled.rate_limited == []


def test_a_browser_push_service_is_not_held_to_one_hosts_share() -> None:
    """Every Chrome user's endpoint is on fcm.googleapis.com: a per-host cap there would hold
    all of them to a few pushes in flight. Those endpoints count against their npub's share
    only; any other Web Push host (user-chosen, perhaps a tarpit) keeps its cap."""
    policies = {"webpush": PlatformPolicy("webpush", lambda d: True, 2)}
    planner_ = Planner(policies, PushConfig(), LimitsConfig(), lambda n: f"c{n}", URL)
    note = event(1, "hello")

    def to(endpoint: str, number: int, owner: str) -> Wakeup:
        device = Device(number, owner, "webpush", endpoint, "iris", (),
                        WebPushKeys("B" * 87, "A" * 22), 0)
        return Wakeup(number, device, json.loads(note)["id"], RELAY, note, NOW, 0)

    chrome = to("https://fcm.googleapis.com/fcm/send/abc", 1, "a" * 64)
    firefox = to("https://updates.push.services.mozilla.com/wpush/v2/x", 2, "b" * 64)
    tarpit = to("https://push.example.org/up/x", 3, "c" * 64)
    busy = {("webpush", "googleapis.com"): 2, ("webpush", "mozilla.com"): 2,
            ("webpush", "example.org"): 2}
    result = planner_.plan([chrome, firefox, tarpit], NOW, busy)
    assert [p.wakeups[0].id for p in result.pushes] == [1, 2]
    assert list(result.held.values()) == [[3]]
    full_npub = {("webpush", "npub:" + "a" * 64): 2}
    assert planner_.plan([to(chrome.device.token, 4, "a" * 64)], NOW, full_npub).pushes == []


def test_one_subscribers_apns_and_fcm_targets_hold_only_their_share_of_the_window() -> None:
    """20 subscriptions of 10 tokens are 200 targets of one key, each with a burst of 20:
    enough to fill the FCM window every phone shares. An Iris target on APNs or FCM counts
    against its subscriber's share (as Web Push endpoints do); phones on the same provider,
    and another subscriber's targets, are not held by it."""
    policies = platform_policies(
        {"android": _Sender("fcm"), "ios": _Sender("apns"), "webpush": _Sender("webpush")},
        {"android": 16, "ios": 16, "webpush": 16},
    )
    assert policies["android"].iris_cap == 2 and policies["android"].host_cap is None
    assert policies["webpush"].iris_cap is None and policies["webpush"].host_cap == 2
    planner_ = Planner(policies, PushConfig(), LimitsConfig(wakeups_per_minute_per_device=0,
                       coalesce_window_ms=0), lambda n: f"c{n}", URL)
    note = event(1, "hello")

    def to(number: int, owner: str, payload: str = "iris") -> Wakeup:
        device = Device(number, owner, "android", f"fcm-token-{number}", payload, (), None, 0)
        return Wakeup(number, device, json.loads(note)["id"], RELAY, note, NOW, 0)

    mine, theirs, phone = to(1, "a" * 64), to(2, "b" * 64), to(3, "a" * 64, "opaque")
    assert endpoint_caps(mine.device) == (("android", "npub:" + "a" * 64),)
    busy = {("android", "npub:" + "a" * 64): 2}
    result = planner_.plan([mine, theirs, phone], NOW, busy)
    assert sorted(p.wakeups[0].id for p in result.pushes) == [2, 3]
    assert [ids for ids in result.held.values()] == [[1]]
    assert len(planner_.plan([to(4, "a" * 64)], NOW, {}).pushes) == 1, "below the share: sent"


class _Sender:
    """What `platform_policies` reads of a sender."""

    def __init__(self, provider: str) -> None:
        self.provider = provider

    def fits(self, data: dict[str, str]) -> bool:
        return True
