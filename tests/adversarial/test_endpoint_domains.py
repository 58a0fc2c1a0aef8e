"""UnifiedPush's per-destination cap once counted exact host names, so one party serving a
wildcard (`a1.evil.example`, `a2.evil.example`, …) got a full share per subdomain. The cap
now counts registrable domains by the Public Suffix List (publicsuffixlist, pinned): what one
party controls. Two real distributors under one public suffix stay apart."""

from __future__ import annotations

from typing import Any

from sigil_push.delivery.plan import endpoint_caps, endpoint_host
from sigil_push.hosts import registrable_domain
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush


def test_registrable_domains() -> None:
    assert registrable_domain("a1.evil.example.com") == "example.com"
    assert registrable_domain("x.up.example.co.uk") == "example.co.uk"
    assert registrable_domain("A.B.Example.COM.") == "example.com"
    # a public suffix with private registrations: each registrant is its own domain
    assert registrable_domain("alice.github.io") != registrable_domain("bob.github.io")
    assert registrable_domain("münchen.de") == registrable_domain("xn--mnchen-3ya.de")
    assert registrable_domain("203.0.113.9") == "203.0.113.9"
    assert registrable_domain("[2001:db8::1]".strip("[]")) == "2001:db8::1"


async def test_wildcard_subdomains_share_one_delivery_cap(
    make_harness: Any, fake_up: FakeUnifiedPush
) -> None:
    harness = await make_harness()
    devices = [
        await harness.register("unifiedpush", f"https://a{i}.push.evil-example.com/up/{i}")
        for i in range(3)
    ]
    other = await harness.register("unifiedpush", "https://up.other-example.org/up/x")
    domains = {endpoint_host(device) for device in devices}
    assert len(domains) == 1
    assert endpoint_host(other) not in domains


async def test_one_npubs_endpoints_on_many_domains_share_one_cap(
    make_harness: Any, fake_up: FakeUnifiedPush
) -> None:
    """Endpoints on different domains each had a full share: one npub registering devices on
    ten domains held ten shares of UnifiedPush's window. Its endpoints now also count against
    one cap for the npub."""
    harness = await make_harness()
    devices = [
        await harness.register("unifiedpush", f"https://up.domain{i}-example.com/up/{i}")
        for i in range(3)
    ]
    caps = [endpoint_caps(device) for device in devices]
    assert len({domain for domain, _ in caps}) == 3
    assert len({npub for _, npub in caps}) == 1
