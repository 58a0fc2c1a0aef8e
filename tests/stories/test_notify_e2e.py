"""Beyond DMs (issue 32), end to end: mentions, reposts, reactions and zaps wake the pairs that
asked for them, under every control, and quiet hours. A real `nostr-relay` process, a whole
sigil-push `Service` in the test's event loop sending to the fake APNs server through the real
aioapns client, events signed by nostr-sdk; each test runs on SQLite and on PostgreSQL.

What a phone receives is what the fake APNs received for its token; what was held back is
seen in the observation log's `suppressed` records (reason and class).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import nostr_sdk
import pytest

from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.harness import eventually
from testkit.in_process import InProcessService, in_process_service
from testkit.nip98 import SdkUser
from testkit.nostr_client import kind4_dm, publish, signed_event
from testkit.paging_relay import PagingRelay
from testkit.phones import DEADLINE, Phone, claim_turns, held_back, suppressed, watched
from testkit.relay import RelayProcess
from testkit.stores import fetch


def _hex(keys: nostr_sdk.Keys | Phone) -> str:
    keys = keys.keys if isinstance(keys, Phone) else keys
    return str(keys.public_key().to_hex())


def _zap(zapper: nostr_sdk.Keys, recipient: Phone, description: str | None = None
         ) -> dict[str, Any]:
    """A zap receipt signed by an LNURL server's key, its `description` the zapper's signed
    kind 9734 (or the text given)."""
    if description is None:
        request = signed_event(zapper, 9734, [["p", _hex(recipient)], ["amount", "21000"]], "gm")
        description = json.dumps(request)
    return signed_event(nostr_sdk.Keys.generate(), 9735,
                  [["p", _hex(recipient)], ["bolt11", "lnbc210n1"], ["description", description]])


def _push_counts(instance: InProcessService) -> dict[str, int]:
    """Push records by event id: one per device the event woke."""
    return dict(Counter(_pushed_ids(instance)))


def _pushed_ids(instance: InProcessService) -> list[str]:
    return [str(r["event_id"]) for r in instance.observation_records() if r["type"] == "push"]


async def test_each_kind_wakes_only_the_pairs_that_asked_for_it_and_never_its_author(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    """One event names four pairs; each is woken only by the kinds of its `notify`. The
    author's own note naming themself wakes nobody and is not counted."""
    dms = Phone(instance, fake_apns, SdkUser())
    mentions = Phone(instance, fake_apns, SdkUser())
    social = Phone(instance, fake_apns, SdkUser())
    everything = Phone(instance, fake_apns, SdkUser())
    await dms.register()
    await mentions.register(notify=["mention"])
    await social.register(notify=["repost", "reaction", "zap"])
    await everything.register(notify=["dm", "mention", "repost", "reaction", "zap"])
    phones = [dms, mentions, social, everything]
    await watched(instance, module_relay.url, 4)
    bob = nostr_sdk.Keys.generate()
    named = [["p", _hex(phone)] for phone in phones]
    note = signed_event(bob, 1, named, "hello all")
    await publish(module_relay.url, note)
    await eventually(lambda: mentions.pushes() == 1 and everything.pushes() == 1, DEADLINE,
                     "the mention pushed to the pairs that asked")
    shared = [signed_event(bob, kind, named, "+") for kind in (6, 16, 7)]
    zaps = [_zap(bob, social), _zap(bob, everything)]
    await publish(module_relay.url, *shared, *zaps)
    # wakeups due together for one phone go out as one push: count the events' records
    expected = {note["id"]: 2, **{e["id"]: 2 for e in shared}, **{z["id"]: 1 for z in zaps}}
    await eventually(lambda: _push_counts(instance) == expected, DEADLINE,
                     "reposts, reaction and zaps pushed to the pairs that asked")
    assert mentions.pushes() == 1 and dms.pushes() == 0
    await publish(module_relay.url, kind4_dm(bob, dms.keys, "a DM"))
    await eventually(lambda: dms.pushes() == 1, DEADLINE, "the DM pushed")
    # the author's own note, naming themself: nothing, not even a record
    own = signed_event(mentions.keys, 1, [["p", _hex(mentions)]], "note to self")
    await publish(module_relay.url, own)
    later = signed_event(bob, 1, [["p", _hex(mentions)]], "after")
    await publish(module_relay.url, later)
    await eventually(lambda: mentions.pushes() == 2, DEADLINE, "the later mention pushed")
    await eventually(lambda: later["id"] in _push_counts(instance), DEADLINE, "its record")
    assert suppressed(instance, own["id"]) is None and own["id"] not in _pushed_ids(instance)
    assert dms.pushes() == 1
    # an opaque wakeup says nothing about the kind that woke it
    bodies = {json.dumps(r.body, sort_keys=True) for r in fake_apns.requests
              if r.token in (mentions.token, social.token)}
    assert len(bodies) == 1


async def test_a_hellthread_wakes_no_one(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    alice = Phone(instance, fake_apns, SdkUser())
    await alice.register(notify=["mention", "reaction"])
    await watched(instance, module_relay.url, 1)
    bob = nostr_sdk.Keys.generate()
    crowd = [["p", _hex(nostr_sdk.Keys.generate())] for _ in range(10)]
    hellthread = signed_event(bob, 1, [*crowd, ["p", _hex(alice)]], "everyone look")
    await publish(module_relay.url, hellthread)
    await held_back(instance, hellthread, "crowded", "mention")
    ten = signed_event(bob, 7, [*crowd[:9], ["p", _hex(alice)]], "+")
    await publish(module_relay.url, ten)
    await eventually(lambda: alice.pushes() == 1, DEADLINE, "ten keys are not a crowd")


async def test_mute_by_key_thread_and_word_and_a_muted_zapper(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    """Alice's kind 10000 mutes Mallory, a thread and a word; her private list mutes a zapper.
    A zap whose request does not verify is anonymous: mutes cannot apply, it wakes."""
    alice = Phone(instance, fake_apns, SdkUser())
    mallory, zapper, bob = (nostr_sdk.Keys.generate() for _ in range(3))
    root = signed_event(bob, 1, [], "the thread")
    await alice.register(notify=["mention", "zap"], muted=[_hex(zapper)])
    await watched(instance, module_relay.url, 1)
    mute_list = signed_event(alice.keys, 10000, [["p", _hex(mallory)], ["e", root["id"]],
                                           ["word", "shitcoin"]])
    await publish(module_relay.url, mute_list)
    await eventually(lambda: _list_flags(instance, alice) & 1, DEADLINE, "the mute list stored")
    by_key = signed_event(mallory, 1, [["p", _hex(alice)]], "hi")
    in_thread = signed_event(bob, 1, [["e", root["id"], "", "root"], ["e", "ab" * 32, "", "reply"],
                                ["p", _hex(alice)]], "deep reply")
    worded = signed_event(bob, 1, [["p", _hex(alice)]], "Buy my SHITCOIN")
    zapped = _zap(zapper, alice)
    await publish(module_relay.url, by_key, in_thread, worded, zapped)
    for event, cls in ((by_key, "mention"), (in_thread, "mention"), (worded, "mention"),
                       (zapped, "zap")):
        await held_back(instance, event, "muted", cls)
    anonymous = _zap(zapper, alice, description="{not json")
    plain = signed_event(bob, 1, [["p", _hex(alice)]], "a fine note")
    await publish(module_relay.url, anonymous, plain)
    await eventually(lambda: sorted(_pushed_ids(instance)) == sorted([anonymous["id"], plain["id"]]),
                     DEADLINE, "the anonymous zap and the note pushed")


def _database(instance: InProcessService) -> str:
    config = instance.service.config
    database = config.server.database
    return database if "://" in database else str(config.resolve(database))


def _list_flags(instance: InProcessService, phone: Phone) -> int:
    """The pair's `list_flags` (1: a mute list stored for its npub, 2: a contact list)."""
    rows = fetch(_database(instance), "SELECT list_flags FROM devices WHERE token = ?",
                 (phone.token,))
    return int(rows[0][0]) if rows else 0


async def test_follows_only_on_a_reaction(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    alice = Phone(instance, fake_apns, SdkUser())
    friend, stranger = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    await alice.register(notify=["reaction"], senders="follows")
    await watched(instance, module_relay.url, 1)
    await publish(module_relay.url, signed_event(alice.keys, 3, [["p", _hex(friend)]]))
    await eventually(lambda: _list_flags(instance, alice) & 2, DEADLINE,
                     "the contact list stored")
    from_stranger = signed_event(stranger, 7, [["p", _hex(alice)]], "+")
    from_friend = signed_event(friend, 7, [["p", _hex(alice)]], "🤙")
    await publish(module_relay.url, from_stranger, from_friend)
    await held_back(instance, from_stranger, "not_followed", "reaction")
    await eventually(lambda: alice.pushes() == 1, DEADLINE, "the friend's reaction pushed")
    await eventually(lambda: _pushed_ids(instance) == [from_friend["id"]], DEADLINE,
                     "its push record")


def _window_around_now(zone: str, ends_in: float) -> tuple[dict[str, str], float]:
    """A quiet window that began a minute ago and ends `ends_in` seconds from now, in `zone`
    (with seconds: the end is computable from the test's clock, no wait for a minute)."""
    now = time.time()
    local = datetime.fromtimestamp(now, ZoneInfo(zone))
    start = local - timedelta(minutes=1)
    end = local + timedelta(seconds=ends_in)
    return ({"from": start.strftime("%H:%M:%S"), "to": end.strftime("%H:%M:%S"), "tz": zone},
            float(int(now + ends_in)))


@pytest.mark.parametrize("paused_meanwhile", [False, True])
async def test_quiet_hours_hold_back_and_send_one_wakeup_at_their_end(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns,
    paused_meanwhile: bool,
) -> None:
    """Inside the window nothing wakes the pair (`quiet`); when it ends, exactly one wakeup
    for what it held, unless the pair was paused meanwhile."""
    alice = Phone(instance, fake_apns, SdkUser())
    await alice.register(notify=["dm", "mention"])
    await watched(instance, module_relay.url, 1)
    quiet, ends_at = _window_around_now("Asia/Kathmandu", 12)
    shown = await alice.preferences(quiet=quiet)
    assert shown["quiet"]["tz"] == "Asia/Kathmandu"
    bob = nostr_sdk.Keys.generate()
    mention = signed_event(bob, 1, [["p", _hex(alice)]], "psst")
    dm = kind4_dm(bob, alice.keys, "late night")
    await publish(module_relay.url, mention, dm)
    await held_back(instance, mention, "quiet", "mention")
    await held_back(instance, dm, "quiet", "dm")
    assert time.time() < ends_at, "the window must still be on: the story needs a longer one"
    assert alice.pushes() == 0
    if paused_meanwhile:
        await alice.preferences(pause_until=int(time.time()) + 3600)
        await eventually(lambda: time.time() > ends_at + 1, DEADLINE, "the window's end")
        await claim_turns(instance)
        assert alice.pushes() == 0
    else:
        await eventually(lambda: alice.pushes() == 1, DEADLINE, "the wakeup at the window's end")
        assert time.time() >= ends_at
        await claim_turns(instance)
        assert alice.pushes() == 1
        await eventually(lambda: _pushed_ids(instance) in ([mention["id"]], [dm["id"]]),
                         DEADLINE, "the wakeup's push record, for one of the held events")
    assert fetch(_database(instance), "SELECT COUNT(*) FROM deferred_wakeups") == [(0,)]


async def test_a_presence_lapse_after_a_later_pause_or_a_muted_sender_sends_nothing_of_them(
    instance: InProcessService, module_relay: RelayProcess, fake_apns: FakeApns
) -> None:
    """Two pairs, each with a presence: one is paused after its presence held a DM, the
    other receives a muted sender's DM and a friend's. When the presences lapse, the paused
    pair gets nothing and the other one wakeup, for the friend's DM (a muted sender's event
    never becomes a deferred wakeup)."""
    paused, open_ = Phone(instance, fake_apns, SdkUser()), Phone(instance, fake_apns, SdkUser())
    mallory, friend = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    await paused.register()
    await open_.register(muted=[_hex(mallory)])
    await watched(instance, module_relay.url, 2)
    await paused.presence(8)
    await open_.presence(8)
    lapse_at = time.time() + 8
    held = kind4_dm(friend, paused.keys, "while open")
    muted = kind4_dm(mallory, open_.keys, "muted")
    kept = kind4_dm(friend, open_.keys, "friendly")
    await publish(module_relay.url, held, muted, kept)
    await held_back(instance, held, "present", "dm")
    await held_back(instance, muted, "muted", "dm")
    await held_back(instance, kept, "present", "dm")
    await paused.preferences(pause_until=int(time.time()) + 3600)
    await eventually(lambda: open_.pushes() == 1, DEADLINE, "the lapse wakeup")
    await eventually(lambda: time.time() > lapse_at + 1, DEADLINE, "both presences lapsed")
    await claim_turns(instance)
    assert (paused.pushes(), open_.pushes()) == (0, 1)
    await eventually(lambda: _pushed_ids(instance) == [kept["id"]], DEADLINE,
                     "the wakeup's push record, for the friend's DM")


async def test_stale_public_events_are_not_pushed_after_a_restart(
    tmp_path: Path, apns_relay_config: dict[str, Any], fake_apns: FakeApns,
) -> None:
    """While the service is down, a reaction from two hours ago and a fresh one reach the
    relay; after the restart, the catch-up pushes the fresh one only and records the old one
    as suppressed for `stale`. The relay serves stored events whatever a filter's `since`, as
    some relays do: the bridge's public-kinds filter reaches back only `stale_after`, so a
    relay that honours it never sends the old one, and only the rule stands between a relay
    that ignores it and yesterday's likes at 3 a.m."""
    apns_relay_config["server"]["observations"] = "observations"
    user = SdkUser()
    async with PagingRelay([], max_limit=500, honours_since=False) as relay:
        apns_relay_config["relay"] = [{"url": relay.url}]
        async with in_process_service(tmp_path, apns_relay_config) as first:
            alice = Phone(first, fake_apns, user)
            await alice.register(notify=["reaction"])
            await watched(first, relay.url, 1)
        bob = nostr_sdk.Keys.generate()
        old = signed_event(bob, 7, [["p", _hex(alice)]], "+", created_at=int(time.time()) - 7200)
        fresh = signed_event(bob, 7, [["p", _hex(alice)]], "🔥")
        relay.events.extend([old, fresh])
        async with in_process_service(tmp_path, apns_relay_config) as second:
            alice.instance = second
            await eventually(lambda: alice.pushes() == 1, DEADLINE, "the fresh reaction caught up")
            await held_back(second, old, "stale", "reaction")
            await watched(second, relay.url, 1)
            await eventually(lambda: _pushed_ids(second) == [fresh["id"]], DEADLINE,
                             "the push record of the fresh reaction")
            assert alice.pushes() == 1
