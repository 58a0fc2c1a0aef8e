"""UnifiedPush delivery (RFC 8030 POST, RFC 8291 encryption via pywebpush) and its SSRF guard."""

from __future__ import annotations

import ipaddress
import json
import socket

import pytest

from sigil_push.devices import WebPushKeys
from sigil_push.push.endpoint_guard import (
    UnsafeEndpoint,
    check_endpoint,
    is_public_address,
    parse_endpoint,
)
from tests.fakes.credentials import WebPushSubscriber
from tests.fakes.fake_unifiedpush import FakeUnifiedPush
from tests.fakes.harness import (
    eventually,
)


async def test_without_keys_the_body_is_the_plain_json_wakeup(make_harness, fake_up: FakeUnifiedPush) -> None:
    harness = await make_harness()
    device = await harness.register("unifiedpush", fake_up.endpoint("plain"))
    await harness.enqueue([device])

    request = (await eventually(lambda: fake_up.received("plain")))[0]
    assert json.loads(request.body) == {"type": "wakeup"}
    assert request.headers["content-type"] == "application/json"
    assert 3500 < int(request.headers["ttl"]) <= 3600
    assert request.headers["topic"] == "wakeup"
    await eventually(harness.drained)
    assert [r["status"] for r in await eventually(harness.push_records)] == ["accepted"]


async def test_with_webpush_keys_the_body_is_rfc8291_encrypted(make_harness, fake_up: FakeUnifiedPush) -> None:
    """Only the holder of the subscription's private key can read the wakeup."""
    harness = await make_harness()
    subscriber = WebPushSubscriber.generate()
    device = await harness.register(
        "unifiedpush", fake_up.endpoint("encrypted"), payload="event_id",
        keys=WebPushKeys(subscriber.p256dh, subscriber.auth),
    )
    event = await harness.enqueue([device])

    request = (await eventually(lambda: fake_up.received("encrypted")))[0]
    assert request.headers["content-encoding"] == "aes128gcm"
    assert event.id.encode() not in request.body
    assert json.loads(subscriber.decrypt(request.body)) == {
        "type": "wakeup", "event_id": event.id, "relay": "wss://relay.example.com"
    }


@pytest.mark.parametrize("status", [404, 410])
async def test_a_gone_endpoint_is_pruned(make_harness, fake_up: FakeUnifiedPush, status: int) -> None:
    harness = await make_harness()
    name = f"gone-{status}"
    fake_up.script.answers[name] = (status, None)
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint(name))])

    await eventually(harness.forgotten, what="device forgotten")
    assert [r["status"] for r in await eventually(harness.push_records)] == ["unregistered"]


async def test_too_large_is_rejected_and_keeps_the_device(make_harness, fake_up: FakeUnifiedPush) -> None:
    harness = await make_harness()
    fake_up.script.answers["large"] = (413, None)
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint("large"))])

    assert [r["status"] for r in await eventually(harness.push_records)] == ["rejected"]
    await eventually(harness.drained)
    assert await harness.devices.count() == 1


async def test_slow_down_honours_retry_after(make_harness, fake_up: FakeUnifiedPush) -> None:
    harness = await make_harness()
    fake_up.script.answers["slow"] = (429, "20")
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint("slow"))])

    await eventually(lambda: harness.push_records())
    answered = harness.push_records()[0]["ts"]
    rows = await eventually(lambda: _released(harness))
    assert rows[0][4] >= answered + 20_000 - 100
    assert len(fake_up.received("slow")) == 1


async def _released(harness):
    rows = await harness.outbox_rows()
    return rows if rows and rows[0][5] is None else None


async def test_server_errors_are_retried(make_harness, fake_up: FakeUnifiedPush) -> None:
    harness = await make_harness()
    fake_up.script.answers["flaky"] = (500, None)
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint("flaky"))])

    await eventually(lambda: len(fake_up.received("flaky")) >= 2, what="retries")
    del fake_up.script.answers["flaky"]
    await eventually(harness.drained)
    await eventually(lambda: [r["status"] for r in harness.push_records()][-1:] == ["accepted"])


async def test_redirects_are_not_followed(make_harness, fake_up: FakeUnifiedPush) -> None:
    """A distributor answering 307 elsewhere gets no second request: the push is rejected."""
    harness = await make_harness()
    fake_up.script.redirects["bouncer"] = "inside"
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint("bouncer"))])

    assert [r["status"] for r in await eventually(harness.push_records)] == ["rejected"]
    assert fake_up.received("inside") == []


def _private_hostname() -> str:
    """This machine's name: an ordinary DNS name (no `localhost` suffix) that resolves to a
    loopback or private address, as a rebinding attacker's name would."""
    name = socket.gethostname()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, 443)}
    except OSError:
        pytest.skip("the host name does not resolve here")
    if any(is_public_address(ipaddress.ip_address(a)) for a in addresses):
        pytest.skip("the host name resolves to a public address here")
    return name


async def test_send_time_check_refuses_names_resolving_to_private_addresses(
    make_harness, fake_up: FakeUnifiedPush
) -> None:
    """A registration whose name resolves (now) to a private address is refused at send time,
    at connection time inside the HTTP client, so nothing reaches the fake."""
    harness = await make_harness(providers={"unifiedpush": {"vapid_subject": "mailto:ops@example.org"}})
    port = fake_up.endpoint("x").split(":")[2].split("/")[0]
    device = await harness.register("unifiedpush", f"https://{_private_hostname()}:{port}/up/rebound")
    await harness.enqueue([device])

    assert [r["status"] for r in await eventually(harness.push_records)] == ["rejected"]
    assert fake_up.received("rebound") == []


@pytest.mark.parametrize("url", [
    "https://127.0.0.1/up", "https://10.1.2.3/up", "https://169.254.169.254/latest",
    "https://100.64.0.1/", "https://0.0.0.0/", "https://224.0.0.1/",
    "https://[::1]/up", "https://[::ffff:127.0.0.1]/up", "https://[::ffff:10.0.0.1]/up",
    "https://[fe80::1%25eth0]/up", "https://[fc00::1]/up", "https://[2002:7f00:1::]/up",
    "https://[64:ff9b::a00:1]/up", "https://[::]/up", "https://[ff02::1]/up",
    "https://localhost/up", "https://LOCALHOST./up", "https://push.localhost/up",
    "https://printer.local/up", "http://push.example.com/up", "ftp://push.example.com/up",
    "https://user:pass@push.example.com/up", "not a url", "https:///up",
])
def test_unsafe_endpoints_are_refused_without_dns(url: str) -> None:
    with pytest.raises(UnsafeEndpoint):
        parse_endpoint(url, allow_private=False)


@pytest.mark.parametrize("url", ["https://127.1/up", "https://2130706433/up", "https://0x7f000001/up"])
def test_ipv4_shorthands_are_refused_as_the_addresses_they_are(url: str) -> None:
    """Not IP literals to a URL parser, but clients connect to them as 127.0.0.1."""
    with pytest.raises(UnsafeEndpoint):
        parse_endpoint(url, allow_private=False)


async def test_dns_names_resolving_to_private_addresses_are_refused() -> None:
    with pytest.raises(UnsafeEndpoint):
        await check_endpoint(f"https://{_private_hostname()}/up", allow_private=False)


@pytest.mark.parametrize("url", ["https://8.8.8.8/up", "https://[2606:4700:4700::1111]/up"])
async def test_public_addresses_pass(url: str) -> None:
    await check_endpoint(url, allow_private=False)


def test_tests_may_allow_private_http_endpoints() -> None:
    assert parse_endpoint("http://127.0.0.1:8080/up", allow_private=True) == ("127.0.0.1", 8080)
