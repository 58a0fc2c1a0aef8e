"""`iris.browser_push_services`: the Web Push hosts exempt from the per-host share of pushes in
flight. The default is the browsers' own push services; an operator's list replaces it (a
private push service added, one dropped), is validated at start (a wildcard over a public
suffix would exempt hosts anyone can register, a tarpit among them), and is what planning
and dispatch both count against."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sigil_push.config import (
    DEFAULT_BROWSER_PUSH_SERVICES,
    ConfigError,
    LimitsConfig,
    PushConfig,
    parse_config,
)
from sigil_push.delivery import Delivery
from sigil_push.delivery.plan import EndpointCaps, Planner, PlatformPolicy
from sigil_push.observations import ObservationLog
from sigil_push.push.registry import TABLES, BrowserPushServices
from sigil_push.store.records import Device, Wakeup, WebPushKeys

URL = "https://iris.example/"
RELAY = "wss://relay.example.com"
NOW = 1_800_000_000_000
NOTE = json.dumps({"id": "e" * 64, "pubkey": "f" * 64, "kind": 1, "content": "hi",
                   "tags": [], "created_at": 1, "sig": "0" * 128})


def iris_table(services: Any) -> Any:
    document = {"iris": {"browser_push_services": services}}
    return parse_config(document, Path("/tmp/relays.toml")).iris


def to(endpoint: str, number: int) -> Wakeup:
    device = Device(number, f"{number:064x}", "webpush", endpoint, "iris", (),
                    WebPushKeys("B" * 87, "A" * 22), 0)
    return Wakeup(number, device, "e" * 64, RELAY, NOTE, NOW, 0)


def test_the_default_is_the_browsers_push_services() -> None:
    assert parse_config({}, Path("/tmp/relays.toml")).iris.browser_push_services == (
        DEFAULT_BROWSER_PUSH_SERVICES)
    services = BrowserPushServices.of(DEFAULT_BROWSER_PUSH_SERVICES)
    assert "fcm.googleapis.com" in services and "web.push.apple.com" in services
    assert "db5p.notify.windows.com" in services and "notify.windows.com" not in services
    assert "evil-fcm.googleapis.com.example.org" not in services


def test_the_operators_list_replaces_it_in_planning() -> None:
    """With `["push.example.net", "*.wns.example.org"]`: Chrome's host is held to its share
    like any other, the listed host and the wildcard's subdomains are not (the wildcard's
    own name is)."""
    iris = iris_table(["push.example.net", "*.wns.example.org"])
    caps = EndpointCaps(BrowserPushServices.of(iris.browser_push_services))
    planner = Planner({"webpush": PlatformPolicy("webpush", lambda d: True, 2)}, PushConfig(),
                      LimitsConfig(), lambda n: f"c{n}", URL, caps)
    wakeups = [to("https://fcm.googleapis.com/fcm/send/a", 1),
               to("https://push.example.net/p/b", 2),
               to("https://eu.wns.example.org/w/c", 3),
               to("https://wns.example.org/w/d", 4)]
    # googleapis.com is a public suffix: fcm.googleapis.com is its own registrable domain
    busy = {("webpush", domain): 2 for domain in ("fcm.googleapis.com", "example.net", "example.org")}
    result = planner.plan(wakeups, NOW, busy)
    assert sorted(p.wakeups[0].id for p in result.pushes) == [2, 3]
    assert sorted(i for ids in result.held.values() for i in ids) == [1, 4]
    nothing = EndpointCaps(BrowserPushServices.of(iris_table([]).browser_push_services))
    assert nothing(wakeups[0].device) == (
        ("webpush", "fcm.googleapis.com"), ("webpush", "npub:" + f"{1:064x}")), "[]: none exempt"


async def test_planning_and_dispatch_count_against_the_configured_list(tmp_path: Path) -> None:
    """The delivery loop builds one `EndpointCaps` from `[iris]` for its planner and its
    dispatcher (the in-flight rows per host are counted where they are capped)."""
    document = {"iris": {"browser_push_services": ["push.example.net"]}}
    config = parse_config(document, tmp_path / "relays.toml", TABLES)
    outbox = SimpleNamespace(collapse_id=lambda wakeup_id: f"c{wakeup_id}")
    delivery = Delivery(outbox, None, {}, ObservationLog(tmp_path / "o"), True,  # type: ignore[arg-type]
                        config.push, config.limits, None, config.iris)
    caps = delivery._planner._caps
    assert caps is delivery._dispatcher._caps
    assert caps(to("https://push.example.net/p/b", 1).device) == (("webpush", "npub:" + f"{1:064x}"),)
    assert len(caps(to("https://fcm.googleapis.com/fcm/send/a", 2).device)) == 2


@pytest.mark.parametrize(
    ("services", "problem"),
    [
        ("fcm.googleapis.com", "must be a list"),
        ([1], "list of strings"),
        (["FCM.googleapis.com"], "lowercase host name"),
        (["fcm.googleapis.com/"], "lowercase host name"),
        (["https://fcm.googleapis.com"], "lowercase host name"),
        (["localhost"], "lowercase host name"),
        (["*"], "lowercase host name"),
        (["*.*.example.org"], "lowercase host name"),
        (["a..example.org"], "lowercase host name"),
        (["-a.example.org"], "lowercase host name"),
        (["x" * 64 + ".example.org"], "lowercase host name"),
        (["bücher.example"], "lowercase host name"),
        (["127.0.0.1"], "an address"),
        (["*.com"], "public suffix"),
        (["*.co.uk"], "public suffix"),
        (["*.googleapis.com"], "public suffix"),
        ([f"h{n}.example.org" for n in range(101)], "at most 100"),
    ],
)
def test_an_invalid_list_is_refused_naming_the_key(services: Any, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        iris_table(services)
    assert refused.value.key == "iris.browser_push_services"
    assert problem in str(refused.value)
