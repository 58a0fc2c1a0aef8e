"""Hostile events against the real service: far-future and replayed `created_at`, events for
keys a relay was never asked about, and forged events that must not reveal who is registered.
Real `nostr-relay` processes without validators (they store and serve anything) or a replay
relay that ignores filters; a real `sigil-push serve` process; waits poll with deadlines."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from testkit.bridge_harness import (
    eventually,
    health,
    metric,
    new_token,
    register,
    relay_live,
    wakeups,
)
from testkit.nostr_client import kind4_dm, publish, relay_list, user
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from tests.adversarial.hostile_relay import ReplayRelay

pytestmark = pytest.mark.slow  # every story here starts its own processes

DROPPED = "sigil_push_bridge_events_dropped_total"
NEAR_2_63 = 2**63 - 1000


async def test_far_future_dm_does_not_stop_the_bridge(
    start_relay: Callable[..., RelayProcess], start_service: Callable[..., ServiceProcess]
) -> None:
    """A correctly signed kind 4 to oneself with `created_at` near 2^63 (once an OverflowError
    that killed the commit loop for good) is dropped and counted; a later DM is still pushed
    and /health stays ok."""
    evil = start_relay("evil", verify_signatures=False)
    service = start_service([evil.url])
    mallory, alice, bob = user(), user(), user()
    register(service, mallory, new_token())
    register(service, alice, new_token())
    await eventually(lambda: relay_live(service, evil.url, 2), "relay subscribed for both keys")

    poison = kind4_dm(mallory, mallory, "boom", created_at=NEAR_2_63)
    tomorrow = kind4_dm(mallory, mallory, "tomorrow", created_at=int(time.time()) + 86_400)
    genuine = kind4_dm(bob, alice, "still working")
    await publish(evil.url, poison, tomorrow)
    await publish(evil.url, genuine)
    await eventually(lambda: wakeups(service)[genuine["id"]] == 1, "a later DM still pushed")
    assert metric(service, DROPPED, relay=evil.url, reason="malformed") >= 1
    assert metric(service, DROPPED, relay=evil.url, reason="too_new") >= 1
    assert wakeups(service)[poison["id"]] == 0 and wakeups(service)[tomorrow["id"]] == 0
    body = health(service)
    assert body["status"] == "ok" and "down" not in body
    assert metric(service, "sigil_push_task_restarts_total") == 0


async def test_far_future_relay_list_is_dropped_before_it_is_stored(
    start_relay: Callable[..., RelayProcess], start_service: Callable[..., ServiceProcess]
) -> None:
    """A kind 10050 list near 2^63 would overflow the list store and pin the list forever; it
    is dropped, and the key's later, real list still takes effect."""
    evil = start_relay("evil", verify_signatures=False)
    inbox = start_relay("inbox")
    service = start_service([evil.url])
    mallory = user()
    register(service, mallory, new_token())
    await eventually(lambda: relay_live(service, evil.url, 1), "relay subscribed")
    await publish(evil.url, relay_list(mallory, 10050, [inbox.url], created_at=int(time.time()) + 86_400))
    await eventually(
        lambda: metric(service, DROPPED, relay=evil.url, reason="too_new") >= 1,
        "the far-future list dropped",
    )
    assert inbox.url not in health(service)["relays"]
    await publish(evil.url, relay_list(mallory, 10050, [inbox.url]))
    await eventually(lambda: relay_live(service, inbox.url, 1), "the real list's inbox watched")
    assert health(service)["status"] == "ok"


async def test_relay_wakes_only_keys_subscribed_there_and_no_replays(
    start_service: Callable[..., ServiceProcess],
) -> None:
    """Bob names his own relay, which ignores filters: it serves a genuine DM for Alice (who
    never named it) and a month-old DM for Bob (a replay from past the dedupe window). Neither
    wakes anyone; a fresh DM for Bob from the same relay does."""
    alice, bob, carol = user(), user(), user()
    for_alice = kind4_dm(carol, alice, "not your relay")
    replayed = kind4_dm(carol, bob, "old news", created_at=int(time.time()) - 30 * 86_400)
    fresh = kind4_dm(carol, bob, "fresh")
    async with ReplayRelay([for_alice, replayed, fresh]) as hostile:
        service = start_service([])
        register(service, alice, new_token())
        register(service, bob, new_token(), relays=[hostile.url])
        await eventually(lambda: wakeups(service)[fresh["id"]] == 1, "Bob's fresh DM pushed")
        await eventually(
            # Bob's relay is a user relay: counted under the users' shared label
            lambda: metric(service, DROPPED, relay="user", reason="too_old") >= 1,
            "the replay dropped as too old",
        )
        await eventually(
            lambda: metric(service, DROPPED, relay="user", reason="unknown_recipient") >= 1,
            "the DM for a key not subscribed there dropped",
        )
        assert wakeups(service)[for_alice["id"]] == 0
        assert wakeups(service)[replayed["id"]] == 0


async def test_forged_events_do_not_tell_who_is_registered(
    start_service: Callable[..., ServiceProcess],
) -> None:
    """A forged event for a registered key and one for an unregistered key, served by a relay
    that ignores filters, move the same public counter: /metrics is no registration oracle."""
    alice, stranger, bob = user(), user(), user()
    other_sig = kind4_dm(bob, bob, "other")["sig"]
    forgeries = [
        {**kind4_dm(bob, alice, "to a registered key"), "sig": other_sig},
        {**kind4_dm(bob, stranger, "to a stranger"), "sig": other_sig},
    ]
    async with ReplayRelay(forgeries) as hostile:
        service = start_service([hostile.url])
        register(service, alice, new_token())

        def counts() -> dict[str, float]:
            return {
                reason: metric(service, DROPPED, relay=hostile.url, reason=reason)
                for reason in ("forged", "unknown_recipient")
            }

        await eventually(lambda: sum(counts().values()) >= 2, "both forgeries counted")
        assert counts()["unknown_recipient"] == 0.0
