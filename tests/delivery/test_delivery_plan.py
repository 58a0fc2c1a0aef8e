"""The planning step on its own: a due batch and the limiter state → pushes and holds.

`Planner.plan` is pure (no I/O, no event loop), so these stories call it with plain outbox
records at chosen times and check what goes now, in which push, with which payload, and
what is held until when. The payload size checks are the providers' own (APNs, UnifiedPush).
"""

from __future__ import annotations

import json

from sigil_push.config import LimitsConfig, PushConfig
from sigil_push.delivery.dispatch import rows_window
from sigil_push.delivery.plan import (
    Plan,
    Planner,
    PlatformPolicy,
    Push,
    endpoint_host,
    platform_policies,
)
from sigil_push.push.apns_sender import apns_size
from sigil_push.push.base import Outcome, Status, WakeupMessage
from sigil_push.push.payload import MAX_PAYLOAD_BYTES
from sigil_push.push.unifiedpush_sender import unifiedpush_size
from sigil_push.store.records import Device, Wakeup, WebPushKeys

NOW = 1_800_000_000_000
RELAY = "wss://relay.example.com"
ENDPOINT = "https://push.example.org/up/"
KEYS = WebPushKeys("BNcRdreALRFXTkOOUHK1EtK2wtaz5Ry4YfYCA_0QTpQtUbVlUls0VJXg7A8u-Ts1XbjhazAkj7I99e8QcYP7DkM",
                   "tBHItJI5svbpez7KI4CCXg")
SEND_TIMEOUT_SECONDS = 10.0


def apns_fits(data: dict[str, str]) -> bool:
    return apns_size(data) <= MAX_PAYLOAD_BYTES


def unifiedpush_fits(data: dict[str, str]) -> bool:
    return unifiedpush_size(data) <= MAX_PAYLOAD_BYTES


POLICIES = {
    "ios": PlatformPolicy("apns", apns_fits, None),
    "unifiedpush": PlatformPolicy("unifiedpush", unifiedpush_fits, 2),
}


def planner(per_minute: int = 0, coalesce_ms: int = 0, max_age: int = 3600,
            max_attempts: int = 12) -> Planner:
    push = PushConfig(max_wakeup_age_seconds=max_age, max_attempts=max_attempts,
                      send_timeout_seconds=SEND_TIMEOUT_SECONDS)
    limits = LimitsConfig(wakeups_per_minute_per_device=per_minute, coalesce_window_ms=coalesce_ms)
    return Planner(POLICIES, push, limits, lambda wakeup_id: f"collapse-{wakeup_id}")


def device(number: int, payload: str = "event_id", platform: str = "ios", token: str = "",
           keys: WebPushKeys | None = None) -> Device:
    """Registration `number`; registrations sharing `token` are accounts on one phone."""
    return Device(number, f"{number:064x}", platform, token or f"{'ab' * 32}", payload, (), keys, 0)


class Rows:
    """Outbox rows with increasing ids, as `due` hands them out."""

    def __init__(self) -> None:
        self.next_id = 1

    def __call__(self, registration: Device, seen_ms: int = NOW, attempts: int = 0,
                 event_json: str | None = None) -> Wakeup:
        number = self.next_id
        self.next_id += 1
        return Wakeup(number, registration, f"{number:064x}", RELAY, event_json, seen_ms, attempts)


def ids(push: Push) -> list[int]:
    return [w.id for w in push.wakeups]


def held_ids(plan: Plan) -> dict[int, list[int]]:
    return {at: sorted(rows) for at, rows in plan.held.items()}


def test_event_id_registrations_get_one_push_per_wakeup_naming_its_event() -> None:
    """Specific payload modes are never coalesced: each wakeup is its own push, carrying its
    event id and relay, its row's collapse id and what is left of its time to live."""
    rows = Rows()
    phone = device(1)
    first, second = rows(phone, seen_ms=NOW - 600_000), rows(phone)

    plan = planner().plan([first, second], NOW, {})

    assert [ids(p) for p in plan.pushes] == [[first.id], [second.id]]
    message = plan.pushes[0].message
    assert message.data == {"type": "wakeup", "event_id": first.event_id, "relay": RELAY}
    assert message.event_ids == (first.event_id,)
    assert message.collapse_id == f"collapse-{first.id}"
    assert message.ttl_seconds == 3600 - 600
    assert not message.opaque
    assert plan.held == {} and plan.coalesced == {}


def test_event_mode_carries_the_event_and_falls_back_to_its_id_when_too_big() -> None:
    """`event` registrations get the full event JSON while it fits the provider's limit; a
    bigger one goes as `event_id` + relay instead (never dropped, never truncated)."""
    rows = Rows()
    small = json.dumps({"id": "1" * 64, "content": "x" * 100})
    big = json.dumps({"id": "2" * 64, "content": "x" * MAX_PAYLOAD_BYTES})
    fits = rows(device(1, "event"), event_json=small)
    too_big = rows(device(2, "event", token="cd" * 32), event_json=big)

    plan = planner().plan([fits, too_big], NOW, {})

    by_row = {p.wakeups[0].id: p.message for p in plan.pushes}
    assert by_row[fits.id].data == {"type": "wakeup", "event": small}
    assert by_row[too_big.id].data == {"type": "wakeup", "event_id": too_big.event_id, "relay": RELAY}
    assert not by_row[too_big.id].opaque


def test_opaque_wakeups_of_every_account_on_a_phone_become_one_push() -> None:
    """Three accounts registered opaque on one phone: one push stands for all their rows,
    carrying nothing but the type, and the coalesced count says two rode along. Another
    phone's wakeup is not folded in."""
    rows = Rows()
    accounts = [device(n, "opaque", token="ab" * 32) for n in (1, 2, 3)]
    wakeups = [rows(accounts[0]), rows(accounts[1]), rows(accounts[2]), rows(accounts[0])]
    other_phone = rows(device(4, "opaque", token="cd" * 32))

    plan = planner().plan([*wakeups, other_phone], NOW, {})

    assert sorted(ids(p) for p in plan.pushes) == [[1, 2, 3, 4], [other_phone.id]]
    together = next(p for p in plan.pushes if len(p.wakeups) == 4)
    assert together.message.data == {"type": "wakeup"}
    assert together.message.opaque
    assert together.message.event_ids == tuple(w.event_id for w in wakeups)
    assert together.message.collapse_id == "collapse-1"
    assert plan.coalesced == {"apns": 3}


def test_a_second_opaque_wakeup_waits_for_the_end_of_the_coalescing_window() -> None:
    """After an opaque push, the phone's next opaque wakeups are held until the window ends
    (on disk, so they travel together then); at the window's end they go as one push."""
    rows = Rows()
    phone = device(1, "opaque")
    plans = planner(coalesce_ms=30_000)
    assert len(plans.plan([rows(phone)], NOW, {}).pushes) == 1

    later = [rows(phone), rows(phone)]
    plan = plans.plan(later, NOW + 10_000, {})
    assert plan.pushes == []
    assert held_ids(plan) == {NOW + 30_000: [w.id for w in later]}

    plan = plans.plan(later, NOW + 30_000, {})
    assert [ids(p) for p in plan.pushes] == [[w.id for w in later]]
    assert plan.held == {}


def test_specific_wakeups_are_not_held_by_the_coalescing_window() -> None:
    """A phone with an opaque account and an event_id account: within the window after an
    opaque push, the event_id wakeup still goes at once while the opaque one waits."""
    rows = Rows()
    opaque, specific = device(1, "opaque"), device(2, "event_id")
    plans = planner(coalesce_ms=30_000)
    plans.plan([rows(opaque)], NOW, {})

    waiting, named = rows(opaque), rows(specific)
    plan = plans.plan([waiting, named], NOW + 1_000, {})

    assert [ids(p) for p in plan.pushes] == [[named.id]]
    assert not plan.pushes[0].message.opaque
    assert held_ids(plan) == {NOW + 30_000: [waiting.id]}


def test_beyond_the_rate_budget_the_excess_rides_in_one_opaque_push_then_waits() -> None:
    """Two pushes a minute per phone, five event_id wakeups due: one goes on its own and the
    other four ride in one opaque push (the budget's last slot). A wakeup due just after
    waits until the bucket has a push again (30 s at two a minute), not a moment less."""
    rows = Rows()
    phone = device(1)
    plans = planner(per_minute=2)
    wakeups = [rows(phone) for _ in range(5)]

    plan = plans.plan(wakeups, NOW, {})

    assert [ids(p) for p in plan.pushes] == [[1], [2, 3, 4, 5]]
    assert not plan.pushes[0].message.opaque
    assert plan.pushes[1].message.opaque
    assert plan.pushes[1].message.data == {"type": "wakeup"}
    assert plan.coalesced == {"apns": 3}

    late = rows(phone)
    plan = plans.plan([late], NOW + 1, {})
    assert plan.pushes == []
    assert held_ids(plan) == {NOW + 30_001: [late.id]}

    plan = plans.plan([late], NOW + 30_001, {})
    assert [ids(p) for p in plan.pushes] == [[late.id]]


def test_the_rate_budget_belongs_to_the_phone_not_the_registration() -> None:
    """Two accounts on one phone share its budget of one push a minute: the second account's
    wakeup is held; a registration on another phone is not."""
    rows = Rows()
    plans = planner(per_minute=1)
    first = rows(device(1, token="ab" * 32))
    plans.plan([first], NOW, {})

    same_phone, other_phone = rows(device(2, token="ab" * 32)), rows(device(3, token="cd" * 32))
    plan = plans.plan([same_phone, other_phone], NOW + 1_000, {})

    assert [ids(p) for p in plan.pushes] == [[other_phone.id]]
    assert list(held_ids(plan).values()) == [[same_phone.id]]
    assert abs(next(iter(plan.held)) - (NOW + 60_000)) <= 1  # a minute after the first push


def test_a_unifiedpush_host_at_its_cap_is_held_while_others_go() -> None:
    """Host cap 2 rows in flight: with one row already in flight at a host, a phone there
    with two wakeups is held (for a quarter of the send timeout); a phone at another host
    goes, and a host with nothing in flight may take a push over its cap."""
    rows = Rows()
    busy_phone = device(1, "opaque", "unifiedpush", ENDPOINT + "a", KEYS)
    idle_phone = device(2, "opaque", "unifiedpush", "https://other.example.net/up/b", KEYS)
    busy = [rows(busy_phone), rows(busy_phone)]
    idle = [rows(idle_phone), rows(idle_phone), rows(idle_phone)]
    in_flight = {endpoint_host(busy_phone): 1}

    plan = planner().plan([*busy, *idle], NOW, in_flight)

    assert [ids(p) for p in plan.pushes] == [[w.id for w in idle]]
    hold_ms = int(1000 * SEND_TIMEOUT_SECONDS / 4)
    assert held_ids(plan) == {NOW + hold_ms: [w.id for w in busy]}


def test_phones_at_one_host_share_its_cap_within_a_batch() -> None:
    """Three phones at one host, nothing in flight, cap 2: the first two pushes fill the cap
    and the third phone's wakeup is held; a push to the same phone with other WebPush keys
    is a separate push (its body is encrypted to other keys)."""
    rows = Rows()
    phones = [device(n, "event_id", "unifiedpush", f"{ENDPOINT}{n}", KEYS) for n in (1, 2, 3)]
    wakeups = [rows(phone) for phone in phones]

    plan = planner().plan(wakeups, NOW, {})

    assert [ids(p) for p in plan.pushes] == [[1], [2]]
    assert list(held_ids(plan).values()) == [[3]]

    other_keys = WebPushKeys(KEYS.p256dh, "AAAAAAAAAAAAAAAAAAAAAA")
    same_endpoint = [rows(device(4, "opaque", "unifiedpush", f"{ENDPOINT}9", keys))
                     for keys in (KEYS, other_keys)]
    plan = planner().plan(same_endpoint, NOW, {})
    assert sorted(ids(p) for p in plan.pushes) == [[same_endpoint[0].id], [same_endpoint[1].id]]


def test_stale_exhausted_and_unroutable_wakeups_are_given_up_not_pushed() -> None:
    """Too old (first seen longer ago than the max age), out of attempts, or for a platform
    without a provider: none becomes a push or a hold; each is listed for giving up."""
    rows = Rows()
    too_old = rows(device(1), seen_ms=NOW - 3_600_001)
    exhausted = rows(device(2, token="cd" * 32), attempts=12)
    unroutable = rows(device(3, platform="android", token="ef" * 32))
    fresh = rows(device(4, token="01" * 32), seen_ms=NOW - 3_599_000)

    plan = planner().plan([too_old, exhausted, unroutable, fresh], NOW, {})

    assert plan.expired == [too_old, exhausted]
    assert plan.unsendable == [unroutable]
    assert [ids(p) for p in plan.pushes] == [[fresh.id]]
    assert plan.pushes[0].message.ttl_seconds == 1
    assert plan.held == {}


class Provider:
    """A sender as planning sees it: its names, its concurrency and its payload check."""

    def __init__(self, platform: str, provider: str, max_concurrency: int) -> None:
        self.platform, self.provider, self.max_concurrency = platform, provider, max_concurrency

    def fits(self, data: dict[str, str]) -> bool:
        return unifiedpush_fits(data)

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        return Outcome(Status.ACCEPTED)

    async def close(self) -> None:
        return None


def test_only_unifiedpush_hosts_are_capped_at_an_eighth_of_the_window() -> None:
    """UnifiedPush endpoints are user-chosen hosts: each may hold an eighth of the platform's
    window of rows in flight (four times its concurrency); APNs is one service, uncapped."""
    senders = {"unifiedpush": Provider("unifiedpush", "unifiedpush", 100),
               "ios": Provider("ios", "apns", 256)}
    windows = {platform: rows_window(sender) for platform, sender in senders.items()}

    policies = platform_policies(senders, windows)

    assert windows == {"unifiedpush": 400, "ios": 1024}
    assert policies["unifiedpush"].host_cap == 50
    assert policies["ios"].host_cap is None
    assert policies["ios"].provider == "apns"
