"""Delivery fairness: UnifiedPush endpoints that accept TCP and never answer, fed with many
wakeups (a user's DMs to themselves, coalesced into big pushes), must not hold another user's
APNs wakeup. The limit found: with one in-flight window for all providers (4 x the sum of the
providers' send slots, 1,504 rows with the defaults), a tarpit push carrying that many rows
stopped every provider until the send timeout; 10 tarpits and 150 DMs stayed far below it.
Here the slots are made small (2 per provider) so a few dozen rows show the same thing."""

from __future__ import annotations

from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.harness import apns_token, eventually
from testkit.tarpit import Tarpit

SLOW = {"concurrency_per_provider": 2, "send_timeout_seconds": 300.0}


async def test_tarpit_unifiedpush_does_not_hold_apns(make_harness, fake_apns: FakeApns) -> None:
    harness = await make_harness(push=SLOW)
    async with Tarpit() as tarpit:
        stuck = [await harness.register("unifiedpush", tarpit.endpoint(f"d{i}")) for i in range(3)]
        for _ in range(40):
            await harness.enqueue(stuck)
        await eventually(lambda: tarpit.connections >= 1, what="a tarpit holding a push")
        token = apns_token()
        victim = await harness.register("ios", token)
        await harness.enqueue([victim])
        await eventually(
            lambda: [r for r in fake_apns.requests if r.token == token],
            timeout=60.0,
            what="the APNs wakeup delivered while the tarpit holds UnifiedPush",
        )
        # the held endpoints use at most their host's share of UnifiedPush's slots
        assert tarpit.connections <= 2
