"""Users decide what wakes their phone (issue 20), end to end: a real `nostr-relay` process, a
whole sigil-push `Service` in the test's event loop (API, bridge, delivery) sending to the fake
APNs server through the real aioapns client, users and DMs made by nostr-sdk. Each test runs
on SQLite and on PostgreSQL.

What a phone receives is what the fake APNs received for its token; what was held back is
seen in the observation log's `suppressed` records and in `sigil_push_suppressed_total`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import nostr_sdk
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.harness import apns_token, eventually
from testkit.in_process import InProcessService, in_process_service
from testkit.nip98 import SdkUser
from testkit.nostr_client import gift_wrap, kind4_dm, publish
from testkit.phones import DEADLINE, Phone, claim_turns, held_back, watched
from testkit.relay import RelayProcess
from testkit.stores import fetch


def _suppressed_total(reason: str) -> float:
    return REGISTRY.get_sample_value("sigil_push_suppressed_total", {"reason": reason}) or 0.0


def _list_event(owner: nostr_sdk.Keys, kind: int, keys: list[str], created_at: int) -> dict[str, Any]:
    builder = nostr_sdk.EventBuilder(nostr_sdk.Kind(kind), "").tags(
        [nostr_sdk.Tag.parse(["p", key]) for key in keys]
    ).custom_created_at(nostr_sdk.Timestamp.from_secs(created_at))
    return dict(json.loads(builder.finalize(owner).as_json()))


def _hex(keys: nostr_sdk.Keys) -> str:
    return str(keys.public_key().to_hex())


async def _replans(instance: InProcessService) -> float:
    """`sigil_push_relay_replans_total` as the service's /metrics reports it."""
    response = await instance.http.get("/metrics")
    assert response.status_code == 200, response.text
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "sigil_push_relay_replans_total":
                return float(sample.value)
    raise AssertionError("sigil_push_relay_replans_total is not in /metrics")


async def test_a_paused_pair_is_not_woken_until_the_pause_is_cleared(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    alice, bob = Phone(instance, fake_apns, SdkUser()), nostr_sdk.Keys.generate()
    await alice.register(pause_until=int(time.time()) + 3600)
    await watched(instance, module_relay.url, 1)
    paused_before = _suppressed_total("paused")
    held = kind4_dm(bob, alice.keys, "while paused")
    await publish(module_relay.url, held)
    await held_back(instance, held, "paused")
    assert _suppressed_total("paused") == paused_before + 1
    await alice.preferences(pause_until=None)
    await publish(module_relay.url, gift_wrap(bob, alice.keys, "after the pause"))
    await eventually(lambda: alice.pushes() == 1, DEADLINE, "the DM after the pause pushed")
    assert alice.pushes() == 1, "the DM held back during the pause is never pushed later"


async def test_presence_ended_by_the_app_sends_no_lapse_wakeup(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    alice, bob = Phone(instance, fake_apns, SdkUser()), nostr_sdk.Keys.generate()
    await alice.register()
    await watched(instance, module_relay.url, 1)
    await alice.presence(300)
    held = gift_wrap(bob, alice.keys, "read in the app")
    await publish(module_relay.url, held)
    await held_back(instance, held, "present")
    await alice.presence(0)
    after = kind4_dm(bob, alice.keys, "app closed")
    await publish(module_relay.url, after)
    await eventually(lambda: alice.pushes() == 1, DEADLINE, "the DM after the presence pushed")
    # the claim loop runs every second: give it several turns to (wrongly) send a lapse wakeup
    await claim_turns(instance)
    assert alice.pushes() == 1


async def test_a_presence_that_lapses_sends_exactly_one_wakeup(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    """The app died in the foreground: the two DMs its presence held back bring one wakeup
    when the presence lapses, and nothing more."""
    alice, bob = Phone(instance, fake_apns, SdkUser()), nostr_sdk.Keys.generate()
    await alice.register()
    await watched(instance, module_relay.url, 1)
    await alice.presence(8)
    first, second = kind4_dm(bob, alice.keys, "one"), kind4_dm(bob, alice.keys, "two")
    await publish(module_relay.url, first, second)
    await held_back(instance, first, "present")
    await held_back(instance, second, "present")
    assert alice.pushes() == 0
    await eventually(lambda: alice.pushes() == 1, DEADLINE, "the lapse wakeup")
    await claim_turns(instance)
    assert alice.pushes() == 1
    # its record names the last DM the presence held back
    await eventually(lambda: [r for r in instance.observation_records() if r["type"] == "push"],
                     DEADLINE, "the lapse wakeup's push record")
    [record] = [r for r in instance.observation_records() if r["type"] == "push"]
    assert record["event_id"] in (first["id"], second["id"]) and record["status"] == "accepted"
    body = next(r.body for r in fake_apns.requests if r.token == alice.token)
    assert body == {"aps": {"alert": {"title": "Sigil", "body": "New message"},
                            "mutable-content": 1, "sound": "default"}}, "an opaque wakeup"


async def test_the_kind_10000_mute_list_applies_and_its_update_too(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    alice = Phone(instance, fake_apns, SdkUser())
    spammer, friend = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    await alice.register()
    await watched(instance, module_relay.url, 1)
    now = int(time.time())
    first = _list_event(alice.keys, 10000, [_hex(spammer)], now - 10)
    await publish(module_relay.url, first)
    await _list_stored(instance, alice, first)
    muted = kind4_dm(spammer, alice.keys, "buy now")
    await publish(module_relay.url, muted)
    await held_back(instance, muted, "muted")
    await publish(module_relay.url, kind4_dm(friend, alice.keys, "hi"))
    await eventually(lambda: alice.pushes() == 1, DEADLINE, "the friend's DM pushed")
    # the spammer's gift wraps pass: their author is hidden
    await publish(module_relay.url, gift_wrap(spammer, alice.keys, "wrapped"))
    await eventually(lambda: alice.pushes() == 2, DEADLINE, "the gift wrap pushed")
    # a newer list without the spammer: applied within seconds of reaching the relay
    newer = _list_event(alice.keys, 10000, [_hex(friend)], now)
    await publish(module_relay.url, newer)
    await _list_stored(instance, alice, newer)
    await publish(module_relay.url, kind4_dm(spammer, alice.keys, "again"))
    await eventually(lambda: alice.pushes() == 3, DEADLINE, "pushed once unmuted")
    # an older list (muting the spammer again) changes nothing
    await publish(module_relay.url, _list_event(alice.keys, 10000, [_hex(spammer)], now - 5))
    await publish(module_relay.url, kind4_dm(spammer, alice.keys, "still allowed"))
    await eventually(lambda: alice.pushes() == 4, DEADLINE, "pushed despite the old list")
    assert _stored_list_id(instance, alice, 10000) == newer["id"]


def _stored_list_id(instance: InProcessService, phone: Phone, kind: int) -> str | None:
    config = instance.service.config
    database = config.server.database
    where = database if "://" in database else str(config.resolve(database))
    rows = fetch(where, "SELECT event_id FROM user_lists WHERE pubkey = ? AND kind = ?",
                 (phone.user.hex, kind))
    return str(rows[0][0]) if rows else None


async def _list_stored(instance: InProcessService, phone: Phone, event: dict[str, Any]) -> None:
    """A list reaching the relay is applied within seconds (DMs after it see it)."""
    await eventually(lambda: _stored_list_id(instance, phone, event["kind"]) == event["id"],
                     DEADLINE, f"kind {event['kind']} stored")


async def test_the_private_mute_list_holds_back_kind_4_only(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    alice, spammer = Phone(instance, fake_apns, SdkUser()), nostr_sdk.Keys.generate()
    await alice.register(muted=[str(spammer.public_key().to_bech32())])
    await watched(instance, module_relay.url, 1)
    assert (await alice.device())["muted_count"] == 1
    muted = kind4_dm(spammer, alice.keys, "buy now")
    await publish(module_relay.url, muted)
    await held_back(instance, muted, "muted")
    await publish(module_relay.url, gift_wrap(spammer, alice.keys, "wrapped"))
    await eventually(lambda: alice.pushes() == 1, DEADLINE, "the gift wrap pushed")
    await alice.preferences(muted=[])
    await publish(module_relay.url, kind4_dm(spammer, alice.keys, "unmuted"))
    await eventually(lambda: alice.pushes() == 2, DEADLINE, "pushed once unmuted")


async def test_follows_only_fails_open_until_a_contact_list_is_known(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    alice = Phone(instance, fake_apns, SdkUser())
    stranger, friend = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    await alice.register(senders="follows")
    await watched(instance, module_relay.url, 1)
    device = await alice.device()
    assert (device["senders"], device["follows_known"]) == ("follows", False)
    await publish(module_relay.url, kind4_dm(stranger, alice.keys, "no kind 3 yet"))
    await eventually(lambda: alice.pushes() == 1, DEADLINE, "pushed: nothing is filtered")
    await publish(module_relay.url, _list_event(alice.keys, 3, [_hex(friend)], int(time.time())))

    async def known() -> bool:
        return bool((await alice.device())["follows_known"])

    await eventually(known, DEADLINE, "follows_known")
    held = kind4_dm(stranger, alice.keys, "not followed")
    await publish(module_relay.url, held)
    await held_back(instance, held, "not_followed")
    await publish(module_relay.url, kind4_dm(friend, alice.keys, "followed"))
    await eventually(lambda: alice.pushes() == 2, DEADLINE, "the friend's DM pushed")
    await publish(module_relay.url, gift_wrap(stranger, alice.keys, "wrapped"))
    await eventually(lambda: alice.pushes() == 3, DEADLINE, "the stranger's gift wrap pushed")


async def test_an_attacker_on_the_victims_token_cannot_silence_the_victim(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    """The attacker learnt the victim's token, registered it for its own npub (allowed: accounts
    on one phone), then paused, presented and muted on it: only its own pair is affected."""
    victim = Phone(instance, fake_apns, SdkUser())
    attacker = Phone(instance, fake_apns, SdkUser(), token=victim.token)
    sender = nostr_sdk.Keys.generate()
    await victim.register()
    await attacker.register()
    await attacker.preferences(pause_until=int(time.time()) + 3600, muted=[_hex(sender)],
                               senders="follows")
    await attacker.presence(300)
    await watched(instance, module_relay.url, 2)
    await publish(module_relay.url, kind4_dm(sender, victim.keys, "for the victim"))
    await eventually(lambda: victim.pushes() == 1, DEADLINE, "the victim's wakeup")
    assert (await victim.device())["pause_until"] is None
    text = json.dumps(instance.observation_records())
    assert victim.token not in text and victim.user.hex not in text and _hex(sender) not in text


async def test_preference_and_presence_calls_share_the_per_npub_rate_limit(tmp_path: Path) -> None:
    """With 3 authenticated requests a minute per npub: register, preferences and presence
    spend the same allowance, and the fourth call is 429 with Retry-After. The suppressed
    counter's four series exist from the start, at zero or more. (The limiter is the API's,
    not the store's: on SQLite only.)"""
    config: dict[str, Any] = {
        "server": {"database": "sigil-push.db", "public_url": "http://127.0.0.1:8080"},
        "limits": {"requests_per_minute_per_ip": 0, "requests_per_minute_per_npub": 3},
    }
    async with in_process_service(tmp_path, config) as instance:
        user, token = SdkUser(), apns_token()
        body = {"npub": user.npub, "platform": "ios", "device_token": token}
        assert (await instance.call(user, "POST", "/register", body)).status_code == 201
        preferences = await instance.call(user, "POST", "/preferences",
                                          {"device_token": token, "senders": "follows"})
        assert preferences.status_code == 200
        presence = await instance.call(user, "POST", "/presence",
                                       {"device_token": token, "seconds": 60})
        assert presence.status_code == 200
        limited = await instance.call(user, "POST", "/presence",
                                      {"device_token": token, "seconds": 0})
        assert limited.status_code == 429 and limited.headers["retry-after"]
        assert limited.json()["error"] == "rate_limited"
    for reason in ("paused", "present", "muted", "not_followed"):
        assert REGISTRY.get_sample_value("sigil_push_suppressed_total", {"reason": reason}) is not None


async def test_a_users_lists_leave_with_the_last_pair(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    """Issue 34, item 6: after `DELETE /unregister` of the npub's last pair, its stored kind
    3 and kind 10000 (up to 2 x 320 KB) go with its other state; while one pair is left they
    stay."""
    alice = Phone(instance, fake_apns, SdkUser())
    tablet = Phone(instance, fake_apns, alice.user)
    await alice.register(senders="follows")
    await tablet.register()
    await watched(instance, module_relay.url, 1)
    now = int(time.time())
    contacts = _list_event(alice.keys, 3, [_hex(nostr_sdk.Keys.generate())], now)
    mutes = _list_event(alice.keys, 10000, [_hex(nostr_sdk.Keys.generate())], now)
    await publish(module_relay.url, contacts, mutes)
    await _list_stored(instance, alice, contacts)
    await _list_stored(instance, alice, mutes)

    async def unregister(phone: Phone) -> None:
        response = await instance.call(phone.user, "DELETE", "/unregister",
                                       {"device_token": phone.token})
        assert response.json() == {"removed": 1}, response.text

    await unregister(tablet)
    await watched(instance, module_relay.url, 1)
    assert _stored_list_id(instance, alice, 3) == contacts["id"]
    await unregister(alice)
    await eventually(lambda: _stored_list_id(instance, alice, 3) is None
                     and _stored_list_id(instance, alice, 10000) is None,
                     DEADLINE, "the lists deleted with the last pair")


async def test_presence_and_preferences_do_not_replan_relays(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    """Issue 34, item 5: `/presence` and `/preferences` change what wakes a pair, never its
    relays. They must take effect (the DM is held back, follows-only reads the kind 3 it now
    needs) without ranking every key's relays again (0.6 s a call at 100,000 keys); a
    registration still does."""
    alice, bob = Phone(instance, fake_apns, SdkUser()), nostr_sdk.Keys.generate()
    friend = nostr_sdk.Keys.generate()
    contacts = _list_event(alice.keys, 3, [_hex(friend)], int(time.time()))
    await publish(module_relay.url, contacts)
    await alice.register()
    await watched(instance, module_relay.url, 1)
    # the kind 3 is read only for a follows-only npub
    assert _stored_list_id(instance, alice, 3) is None
    replans = await _replans(instance)
    await alice.presence(300)
    held = kind4_dm(bob, alice.keys, "while present")
    await publish(module_relay.url, held)
    await held_back(instance, held, "present")
    await alice.presence(0)
    await alice.preferences(pause_until=int(time.time()) + 60, muted=[_hex(bob)])
    await alice.preferences(pause_until=None, muted=[], senders="follows")
    await _list_stored(instance, alice, contacts)

    async def known() -> bool:
        return bool((await alice.device())["follows_known"])

    await eventually(known, DEADLINE, "follows_known")
    held = kind4_dm(bob, alice.keys, "not followed")
    await publish(module_relay.url, held)
    await held_back(instance, held, "not_followed")
    # a new `notify` kind reaches the relay's REQ (its shard re-asked) without a re-plan
    await alice.preferences(senders="anyone", notify=["dm", "mention"])
    before = alice.pushes()
    mention = nostr_sdk.EventBuilder(nostr_sdk.Kind(1), "a mention").tags(
        [nostr_sdk.Tag.parse(["p", _hex(alice.keys)])]
    ).finalize(bob)
    await publish(module_relay.url, dict(json.loads(mention.as_json())))
    await eventually(lambda: alice.pushes() == before + 1, DEADLINE, "the mention pushed")
    assert await _replans(instance) == replans, "a preference or presence call re-planned"
    await Phone(instance, fake_apns, SdkUser()).register()

    async def replanned() -> bool:
        return await _replans(instance) > replans

    await eventually(replanned, DEADLINE, "a registration re-plans")
