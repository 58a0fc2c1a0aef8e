"""Iris subscriptions wake their targets (issue 33, matching): a real `nostr-relay` process, a
real `sigil-push serve` process in dry-run, subscriptions made through the Iris API the way
Iris makes them (trailing slashes, `btoa` NIP-98 without `payload`), events signed by
nostr-sdk. A target here is an FCM token in the subscription (`fcm_tokens`), which dry-run
logs per push like any device: the matching, the Iris rules and the outbox rows are the same
for every kind of target (Web Push delivery is the Iris sender's; see test_iris_story.py).

Run on SQLite and PostgreSQL: subscriptions reach the bridge through the store's listeners
(in-process on SQLite, NOTIFY on PostgreSQL).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import nostr_sdk
import pytest

from testkit.bridge_harness import (
    assert_private,
    eventually,
    metric,
    new_token,
    relay_subscribed,
    wakeups,
)
from testkit.iris_client import IrisClient
from testkit.nip98 import SdkUser
from testkit.nostr_client import hex_of, publish, signed_event
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import Engine, fetch

pytestmark = pytest.mark.slow  # starts its own processes



def _suppressed(service: ServiceProcess, event_id: str) -> tuple[str, str] | None:
    for record in service.observation_records():
        if record["type"] == "suppressed" and record["event_id"] == event_id:
            return str(record["reason"]), str(record["class"])
    return None


async def test_iris_subscriptions_wake_their_targets_once_under_the_iris_rules(
    engine: Engine,
    start_relay: Callable[..., RelayProcess],
    start_service: Callable[..., ServiceProcess],
    http_of: Callable[[ServiceProcess], httpx.Client],
) -> None:
    """Iris's two subscriptions on one target, plus a third naming it too: a mention, a kind
    1060 by a session key, an event matching two subscriptions (one push), the subscriber's
    own note (nothing), a hellthread (`crowded`), a muted author (kind 10000: `muted`), a
    follows-only subscription (`not_followed`), a key rotation and a deletion."""
    relay = start_relay("a")
    service = start_service([relay.url], FAST_RECONNECT)
    http = http_of(service)
    me = SdkUser()
    iris = IrisClient(http, me, service.url)
    token, other_token = new_token(), new_token()
    session, rotated = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    bob, carol, dave = (nostr_sdk.Keys.generate() for _ in range(3))

    mentions = {"filter": {"#p": [me.hex], "kinds": [1, 6, 7, 9735]},
                "fcm_tokens": [token], "web_push_subscriptions": [], "webhooks": []}
    messages = {"filter": {"kinds": [1060], "authors": [hex_of(session)]},
                "fcm_tokens": [token], "web_push_subscriptions": [], "webhooks": []}
    response = iris.request("POST", "subscriptions", mentions)
    assert response.status_code == 201, response.text
    response = iris.request("POST", "subscriptions", messages)
    assert response.status_code == 201, response.text
    messages_id = response.json()["id"]
    # a third subscription naming the same target, and one that is follows-only
    from_bob = {"filter": {"kinds": [1], "authors": [hex_of(bob)]}, "fcm_tokens": [token]}
    assert iris.request("POST", "subscriptions/", from_bob).status_code == 201
    friends = {"filter": {"#p": [me.hex], "kinds": [7]}, "fcm_tokens": [other_token],
               "social_graph_filter": True}
    assert iris.request("POST", "subscriptions/", friends).status_code == 201
    await eventually(lambda: relay_subscribed(service, relay.url), "the watch REQ sent")

    # the subscriber's lists: carol muted, bob followed
    await publish(relay.url,
                  signed_event(me.keys, 10000, [["p", hex_of(carol)]]),
                  signed_event(me.keys, 3, [["p", hex_of(bob)]]))
    await eventually(
        lambda: metric(service, "sigil_push_bridge_user_lists_total", outcome="stored") >= 2,
        "the subscriber's mute and contact lists stored",
    )

    mention = signed_event(dave, 1, [["p", me.hex]], "hi")
    message = signed_event(session, 1060, [["p", "ab" * 32]], "ciphertext")
    both = signed_event(bob, 1, [["p", me.hex]], "matches two subscriptions")
    await publish(relay.url, mention, message, both)
    await eventually(
        lambda: all(wakeups(service)[e["id"]] == 1 for e in (mention, message, both)),
        "the mention, the session key's message and bob's note pushed",
    )

    own = signed_event(me.keys, 1, [["p", me.hex]], "note to self")
    crowded = signed_event(dave, 1, [["p", me.hex]] + [["p", f"{i:064x}"] for i in range(1, 11)])
    muted = signed_event(carol, 1, [["p", me.hex]], "muted")
    stranger_reaction = signed_event(dave, 7, [["p", me.hex]], "+")
    friend_reaction = signed_event(bob, 7, [["p", me.hex]], "+")
    await publish(relay.url, own, crowded, muted, stranger_reaction, friend_reaction)
    await eventually(lambda: wakeups(service)[friend_reaction["id"]] == 2,
                     "a followed author's reaction pushed to both targets")
    await eventually(lambda: _suppressed(service, muted["id"]) is not None, "muted recorded")
    assert _suppressed(service, muted["id"]) == ("muted", "iris")
    assert _suppressed(service, crowded["id"]) == ("crowded", "iris")
    # a stranger's reaction wakes the target whose subscription is not follows-only only
    assert wakeups(service)[stranger_reaction["id"]] == 1
    assert wakeups(service)[own["id"]] == 0 and _suppressed(service, own["id"]) is None
    assert wakeups(service)[crowded["id"]] == 0 and wakeups(service)[muted["id"]] == 0

    # key rotation: Iris re-posts the subscription with its new session key
    messages["filter"] = {"kinds": [1060], "authors": [hex_of(rotated)]}
    response = iris.request("POST", f"subscriptions/{messages_id}", messages)
    assert response.status_code == 200, response.text
    old_key = signed_event(session, 1060, [["p", "ab" * 32]], "old session")
    new_key = signed_event(rotated, 1060, [["p", "ab" * 32]], "new session")
    await publish(relay.url, new_key)
    await eventually(lambda: wakeups(service)[new_key["id"]] == 1, "the new key's message")
    await publish(relay.url, old_key)
    marker = signed_event(dave, 1, [["p", me.hex]], "marker")
    await publish(relay.url, marker)
    await eventually(lambda: wakeups(service)[marker["id"]] == 1, "a later mention pushed")
    assert wakeups(service)[old_key["id"]] == 0

    # deletion: nothing of that subscription wakes anyone any more, once the bridge has it
    # (the API answers when the store has it; the bridge hears of it a moment later)
    filters = metric(service, "sigil_push_bridge_iris_watches")
    assert iris.request("DELETE", f"subscriptions/{messages_id}").status_code == 204
    await eventually(lambda: metric(service, "sigil_push_bridge_iris_watches") == filters - 1,
                     "the bridge dropped the subscription's filter")
    after = signed_event(rotated, 1060, [["p", "ab" * 32]], "after deletion")
    await publish(relay.url, after)
    marker = signed_event(dave, 1, [["p", me.hex]], "second marker")
    await publish(relay.url, marker)
    await eventually(lambda: wakeups(service)[marker["id"]] == 1, "a later mention pushed")
    assert wakeups(service)[after["id"]] == 0

    assert metric(service, "sigil_push_bridge_events_pushed_by_class_total", **{"class": "iris"}) >= 6
    assert_private(service, [me.hex, hex_of(session), hex_of(rotated), token, other_token])

    # the subscriber has no registration: its lists leave with its last subscription
    lists = "SELECT kind FROM user_lists WHERE pubkey = ?"
    assert sorted(row[0] for row in fetch(service.database, lists, (me.hex,))) == [3, 10000]
    listed = iris.request("GET", "subscriptions")
    assert listed.status_code == 200, listed.text
    for subscription_id in listed.json():
        assert iris.request("DELETE", f"subscriptions/{subscription_id}").status_code == 204
    await eventually(lambda: not fetch(service.database, lists, (me.hex,)),
                     "the subscriber's mute and contact lists deleted")


async def test_what_matched_while_the_service_was_down_is_pushed_once_after_it_returns(
    start_relay: Callable[..., RelayProcess],
    start_service: Callable[..., ServiceProcess],
    http_of: Callable[[ServiceProcess], httpx.Client],
) -> None:
    """Catch-up and de-duplication as for DMs: a mention and a session key's message sent
    while the service is stopped are pushed once when it returns (the watch REQs reach back
    to the relay's stored cursor); what was pushed before the stop is not pushed again."""
    relay = start_relay("r")
    service = start_service([relay.url], FAST_RECONNECT)
    me = SdkUser()
    iris = IrisClient(http_of(service), me, service.url)
    token, session, bob = new_token(), nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    for subscription in ({"filter": {"#p": [me.hex], "kinds": [1, 7]}, "fcm_tokens": [token]},
                         {"filter": {"kinds": [1060], "authors": [hex_of(session)]},
                          "fcm_tokens": [token]}):
        assert iris.request("POST", "subscriptions/", subscription).status_code == 201
    await eventually(lambda: relay_subscribed(service, relay.url), "the watch REQ sent")
    before = signed_event(bob, 1, [["p", me.hex]], "before")
    await publish(relay.url, before)
    await eventually(lambda: wakeups(service)[before["id"]] == 1, "pushed before the stop")
    await eventually(lambda: not fetch(service.database, "SELECT 1 FROM outbox"), "outbox empty")

    service.stop()
    while_down = [signed_event(bob, 7, [["p", me.hex]], "+"),
                  signed_event(session, 1060, [["p", "ab" * 32]], "while down")]
    await publish(relay.url, *while_down)
    service.start()
    await eventually(lambda: all(wakeups(service)[e["id"]] == 1 for e in while_down),
                     "what matched while down pushed")
    after = signed_event(bob, 1, [["p", me.hex]], "after")
    await publish(relay.url, after)
    await eventually(lambda: wakeups(service)[after["id"]] == 1, "live again")
    assert wakeups(service)[before["id"]] == 1
    assert all(wakeups(service)[e["id"]] == 1 for e in while_down)


async def test_a_gift_wrap_dated_up_to_two_days_before_its_target_was_added_wakes_it(
    start_relay: Callable[..., RelayProcess],
    start_service: Callable[..., ServiceProcess],
    http_of: Callable[[ServiceProcess], httpx.Client],
) -> None:
    """NIP-59 dates a gift wrap up to two days in the past: a kind 1059 sent after the
    subscription was made but dated a day before it wakes the target, as a DM does a
    registration's device; one dated three days back does not (history, as before), and a
    kind 1 dated a day back is history too (only wraps get the allowance)."""
    relay = start_relay("g")
    service = start_service([relay.url], FAST_RECONNECT)
    me = SdkUser()
    iris = IrisClient(http_of(service), me, service.url)
    token, bob = new_token(), nostr_sdk.Keys.generate()
    subscription = {"filter": {"#p": [me.hex], "kinds": [1, 1059]}, "fcm_tokens": [token]}
    assert iris.request("POST", "subscriptions/", subscription).status_code == 201
    await eventually(lambda: relay_subscribed(service, relay.url), "the watch REQ sent")
    now = int(time.time())
    day = 24 * 3600
    wrap = signed_event(bob, 1059, [["p", me.hex]], "wrap", created_at=now - day)
    old_wrap = signed_event(bob, 1059, [["p", me.hex]], "old wrap", created_at=now - 3 * day + 600)
    old_note = signed_event(bob, 1, [["p", me.hex]], "old note", created_at=now - day)
    await publish(relay.url, old_wrap, old_note, wrap)
    marker = signed_event(bob, 1, [["p", me.hex]], "marker")
    await publish(relay.url, marker)
    await eventually(lambda: wakeups(service)[marker["id"]] == 1, "a later mention pushed")
    await eventually(lambda: wakeups(service)[wrap["id"]] == 1, "the backdated wrap pushed")
    assert wakeups(service)[old_wrap["id"]] == 0
    assert wakeups(service)[old_note["id"]] == 0
    assert_private(service, [me.hex, token])
