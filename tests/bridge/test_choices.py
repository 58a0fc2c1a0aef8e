"""The wake rules on their own (`bridge.choices`), and the watches they are asked about.

`judge` is pure (no I/O, no event loop): these stories build an event's facts and a pair's
rules at chosen times and check which rule, in the contract's order, keeps the pair asleep,
when the stored lists must be read first (`ASK`), and what a quiet window does around
midnight and across a daylight-saving change.
"""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from sigil_push.bridge.choices import (
    ASK,
    CROWDED,
    IRIS_RULES,
    MUTED,
    NOT_FOLLOWED,
    PAUSED,
    PRESENT,
    QUIET,
    RULES,
    SELF,
    STALE,
    SUPPRESS_REASONS,
    Effect,
    facts_of,
    iris_device,
    iris_facts,
    judge,
    thread_ids,
)
from sigil_push.bridge.watches import (
    DEFAULT_MASK,
    InvalidFilter,
    WatchIndex,
    filter_watches,
    mask_classes,
    mask_kinds,
    notify_mask,
    registration_watch,
    subscription_watches,
    wants_kind,
)
from sigil_push.store.preferences import Listed
from sigil_push.store.records import Device, QuietHours, Rules, pack_keys

NOW = 1_800_000_000
OWNER = "aa" * 32
ALICE = "a1" * 32
MALLORY = "66" * 32
ROOT = "e0" * 32


def pair(rules: Rules | None = None, owner: str = OWNER) -> Device:
    return Device(1, owner, "ios", "ab" * 32, "opaque", (), None, 0, None, rules)


def rules(**changes: object) -> Rules:
    base = Rules(None, "anyone", None, 0, False, False)
    return base._replace(**changes)


def facts(kind: int = 4, author: str = ALICE, created_at: int = NOW, p_count: int = 1,
          tags: tuple[tuple[str, ...], ...] = (), content: str = "", zap: str | None = None,
          ) -> object:
    return facts_of(kind, author, created_at, tags, content, p_count, zap, NOW, 10, 3600)


def test_the_reasons_are_the_table_in_the_contracts_order() -> None:
    assert SUPPRESS_REASONS == ("crowded", "stale", "paused", "muted", "not_followed",
                                "present", "quiet", "rate_limited")
    assert [r for r in RULES if r.effect is Effect.DEFER] == [PRESENT, QUIET]
    assert SELF.effect is Effect.IGNORE


def test_own_events_never_wake_and_are_not_counted() -> None:
    assert judge(facts(author=OWNER), pair(), NOW, None) is SELF
    # a zap whose verified request is the owner's own
    assert judge(facts(kind=9735, author=MALLORY, zap=OWNER), pair(), NOW, None) is SELF


def test_a_hellthread_and_a_stale_public_event_wake_no_one_whatever_the_pair_chose() -> None:
    assert judge(facts(kind=1, p_count=11), pair(), NOW, None) is CROWDED
    assert judge(facts(kind=1, p_count=10), pair(), NOW, None) is None
    # DMs and zaps are never crowded; a DM is never stale
    assert judge(facts(kind=4, p_count=50), pair(), NOW, None) is None
    assert judge(facts(kind=9735, p_count=50), pair(), NOW, None) is None
    assert judge(facts(kind=7, created_at=NOW - 3601), pair(), NOW, None) is STALE
    assert judge(facts(kind=9735, created_at=NOW - 3601), pair(), NOW, None) is STALE
    assert judge(facts(kind=4, created_at=NOW - 86_400), pair(), NOW, None) is None


def test_pause_comes_before_the_lists_which_come_before_presence_and_quiet() -> None:
    muting = rules(muted_count=1, pause_until=NOW + 60, present_until=NOW + 60)
    assert judge(facts(), pair(muting), NOW, None) is PAUSED
    present = muting._replace(pause_until=None)
    assert judge(facts(), pair(present), NOW, None) is ASK
    muted = Listed(private=pack_keys([ALICE]))
    assert judge(facts(), pair(present), NOW, muted) is MUTED
    assert judge(facts(), pair(present), NOW, Listed(private=pack_keys([MALLORY]))) is PRESENT
    # a pause already over suppresses nothing
    assert judge(facts(), pair(rules(pause_until=NOW)), NOW, None) is None


def test_a_gift_wrap_and_an_anonymous_zap_hide_their_author_from_mute_and_follows() -> None:
    picky = rules(muted_count=1, senders="follows", follows_known=True)
    assert judge(facts(kind=1059), pair(picky), NOW, None) is None
    assert judge(facts(kind=9735, zap=None), pair(picky), NOW, None) is None
    zapped = facts(kind=9735, author=MALLORY, zap=ALICE)
    assert judge(zapped, pair(picky), NOW, None) is ASK
    assert judge(zapped, pair(picky), NOW, Listed(private=pack_keys([ALICE]))) is MUTED
    # the receipt's signer (the LNURL server) is not the author
    assert judge(zapped, pair(picky), NOW, Listed(private=pack_keys([MALLORY]),
                                                  follows=pack_keys([ALICE]))) is None


def test_follows_only_applies_once_a_contact_list_is_known() -> None:
    picky = rules(senders="follows", follows_known=True)
    reaction = facts(kind=7)
    assert judge(reaction, pair(picky), NOW, Listed(follows=pack_keys([MALLORY]))) is NOT_FOLLOWED
    assert judge(reaction, pair(picky), NOW, Listed(follows=pack_keys([ALICE]))) is None
    assert judge(reaction, pair(picky._replace(follows_known=False)), NOW, None) is None


def test_muted_threads_by_root_or_reply_and_muted_words_case_insensitive() -> None:
    listing = rules(mute_list=True)
    reply = facts(kind=1, tags=(("e", ROOT, "", "root"), ("e", "e1" * 32, "", "reply")))
    assert judge(reply, pair(listing), NOW, None) is ASK
    assert judge(reply, pair(listing), NOW, Listed(mute_threads=pack_keys([ROOT]))) is MUTED
    # old clients: the first `e` is the root, the last the reply
    positional = facts(kind=1, tags=(("e", ROOT), ("e", "e2" * 32), ("e", "e3" * 32)))
    assert judge(positional, pair(listing), NOW, Listed(mute_threads=pack_keys(["e3" * 32]))) is MUTED
    assert judge(positional, pair(listing), NOW, Listed(mute_threads=pack_keys(["e2" * 32]))) is None
    worded = facts(kind=1, content="Buy my SHITCOIN now")
    assert judge(worded, pair(listing), NOW, Listed(mute_words=("shitcoin",))) is MUTED
    assert judge(worded, pair(listing), NOW, Listed(mute_words=("nft",))) is None
    # words and threads are a kind 1's: a reaction's content is not searched
    assert judge(facts(kind=7, content="shitcoin"), pair(listing), NOW,
                 Listed(mute_words=("shitcoin",))) is None


def test_thread_ids_skip_malformed_tags() -> None:
    assert thread_ids((("e", "zz" * 32, "", "root"), ("e",), ("p", ROOT))) == ()
    assert thread_ids((("e", ROOT, "", "root"),)) == (bytes.fromhex(ROOT),)


def _at(zone: str, year: int, month: int, day: int, hour: int, minute: int) -> int:
    return int(datetime(year, month, day, hour, minute, tzinfo=ZoneInfo(zone)).timestamp())


def test_a_quiet_window_crossing_midnight_and_its_end() -> None:
    window = QuietHours(22 * 3600, 7 * 3600, "Europe/Berlin")
    late = _at("Europe/Berlin", 2026, 1, 10, 23, 30)
    assert window.inside(late) and window.inside(late + 6 * 3600)
    assert not window.inside(late + 8 * 3600)
    assert window.end_after(late) == _at("Europe/Berlin", 2026, 1, 11, 7, 0)
    quiet = pair(rules(quiet=window))
    assert judge(facts(), quiet, late, None) is QUIET
    assert judge(facts(), quiet, late + 8 * 3600, None) is None


def test_a_quiet_window_follows_daylight_saving() -> None:
    """Berlin moves from UTC+1 to UTC+2 early on 29 March 2026: 07:00 local is 06:00 UTC on the
    28th and 05:00 UTC on the 29th and after."""
    window = QuietHours(22 * 3600, 7 * 3600, "Europe/Berlin")
    before = window.end_after(_at("Europe/Berlin", 2026, 3, 27, 23, 0))
    after = window.end_after(_at("Europe/Berlin", 2026, 3, 29, 23, 0))
    assert datetime.fromtimestamp(before, ZoneInfo("UTC")).hour == 6
    assert datetime.fromtimestamp(after, ZoneInfo("UTC")).hour == 5


def test_notify_masks_and_kinds() -> None:
    assert mask_classes(DEFAULT_MASK) == ["dm"]
    mask = notify_mask(["zap", "reaction"])
    assert mask_classes(mask) == ["reaction", "zap"]
    assert mask_kinds(mask) == {7, 9735}
    assert wants_kind(mask, 7) and not wants_kind(mask, 4) and not wants_kind(mask, 30078)
    assert mask_kinds(notify_mask(["dm", "repost"])) == {4, 1059, 6, 16}


def test_watches_index_p_and_authors_before_anything_is_verified() -> None:
    index = WatchIndex()
    index.add(registration_watch(OWNER, 1, notify_mask(["mention"])))
    iris = filter_watches(ALICE, 2, {"kinds": [1060], "authors": [MALLORY], "since": 5})
    index.add(iris)
    tagged = filter_watches(ALICE, 3, {"#p": [ALICE], "kinds": [1, 7], "#t": ["nostr"]})
    index.add(tagged)
    assert index.candidates([OWNER], None)[0].kinds == {1}
    assert index.candidates(["ff" * 32], MALLORY) == [iris]
    assert index.kinds_for("#p", ALICE) == {1, 7}
    assert tagged.matches(7, MALLORY, (("p", ALICE), ("t", "nostr")), "00" * 32)
    assert not tagged.matches(7, MALLORY, (("p", ALICE),), "00" * 32)
    index.remove_target(ALICE, 3)
    assert index.candidates([ALICE], None) == []
    for bad in ({"kinds": [1]}, {"#p": "x"}, {"kinds": ["1"], "#p": [ALICE]}, {"search": ["x"]}):
        with pytest.raises(InvalidFilter):
            filter_watches(ALICE, 4, bad)


def iris_target(rules: Rules | None = None) -> Device:
    return Device(7, OWNER, "webpush", "https://push.example/x", "iris", (), None, 0, None, rules)


def test_iris_targets_are_judged_by_the_iris_subset_only() -> None:
    """An Iris target: its own events never, a hellthread only through a `#p` match (any
    kind), the subscriber's kind 10000 `p` tags, follows-only per subscription; nothing of a
    registration's pause, presence, quiet hours, staleness or thread and word mutes."""
    base = facts(kind=1, p_count=11, created_at=NOW - 86_400, content="spoiler",
                 tags=(("e", ROOT, "", "root"),))
    lists = Listed(mute_keys=pack_keys([ALICE]), mute_threads=pack_keys([ROOT]),
                   mute_words=("spoiler",), follows=pack_keys([MALLORY]))
    flags = rules(mute_list=True, follows_known=True, pause_until=NOW + 60,
                  present_until=NOW + 60, quiet=QuietHours(0, 86_399, "UTC"))
    crowded_by_p = iris_facts(base, True, 11, 10)
    by_author = iris_facts(base, False, 11, 10)
    assert crowded_by_p.cls == "iris" and not by_author.crowded and not by_author.stale
    assert judge(crowded_by_p, iris_device(iris_target(flags), False), NOW, None) is CROWDED
    # a hellthread of a kind registrations never call crowded (a 1060) is crowded for Iris
    odd = iris_facts(facts(kind=1060, p_count=12), True, 12, 10)
    assert judge(odd, iris_device(iris_target(), False), NOW, None) is CROWDED
    target = iris_device(iris_target(flags), False)
    assert target.rules is not None and target.rules.pause_until is None
    assert judge(by_author, target, NOW, None) is ASK
    assert judge(by_author, target, NOW, lists) is MUTED  # ALICE is in the kind 10000
    stranger = iris_facts(facts(kind=1, author=ROOT, content="spoiler",
                                tags=(("e", ROOT, "", "root"),)), False, 1, 10)
    # no thread or word mutes, no presence or quiet hours: it wakes
    assert judge(stranger, target, NOW, lists) is None
    follows_only = iris_device(iris_target(flags), True)
    assert judge(stranger, follows_only, NOW, lists) is NOT_FOLLOWED
    friend = iris_facts(facts(kind=7, author=MALLORY), True, 1, 10)
    assert judge(friend, follows_only, NOW, lists) is None
    # no contact list stored: follows-only filters nothing (as `follows_known: false`)
    assert iris_device(iris_target(), True).rules is None
    own = iris_facts(facts(kind=1060, author=OWNER), False, 0, 10)
    assert judge(own, iris_device(iris_target(flags), True), NOW, None) is SELF
    # whatever the case, `judge` says what the Iris subset alone would say
    for event_facts in (crowded_by_p, by_author, stranger, friend, own, odd):
        for device in (target, follows_only, iris_device(iris_target(), False)):
            for listed in (None, lists, Listed()):
                assert judge(event_facts, device, NOW, listed) == judge(
                    event_facts, device, NOW, listed, IRIS_RULES
                )


def test_a_subscription_compiles_to_one_watch_per_filter_for_all_its_targets() -> None:
    document = {
        "filter": {"#p": [OWNER], "kinds": [1, 6, 7, 9735], "since": 5},
        "filters": [{"kinds": [1060], "authors": [MALLORY]}, {"kinds": [1]}, "junk"],
        "social_graph_filter": True,
    }
    watches = subscription_watches(OWNER, [9, 4], document)
    assert [(w.index, w.keys, w.devices, w.follows_only) for w in watches] == [
        ("#p", {OWNER}, (4, 9), True), ("authors", {MALLORY}, (4, 9), True),
    ]
    assert subscription_watches(OWNER, [], document) == []


def test_the_index_changes_per_owner_at_the_cost_of_that_owners_watches() -> None:
    index = WatchIndex()
    others = [filter_watches(f"{n:064x}", n, {"#p": [OWNER], "kinds": [1]}) for n in range(500)]
    for watch in others:
        index.add(watch)
    mine = subscription_watches(ALICE, [1], {"filter": {"kinds": [1060], "authors": [MALLORY]}})
    index.replace_owner(ALICE, mine)
    assert index.candidates([], MALLORY) == mine and index.has_owner(ALICE)
    rotated = subscription_watches(ALICE, [1], {"filter": {"kinds": [1060], "authors": [ROOT]}})
    index.replace_owner(ALICE, rotated)
    assert index.candidates([], MALLORY) == [] and index.candidates([], ROOT) == rotated
    assert index.kinds_for("authors", ROOT) == {1060}
    index.replace_owner(ALICE, [])
    assert not index.has_owner(ALICE) and index.author_keys() == frozenset()
    assert len(index.candidates([OWNER], None)) == 500
