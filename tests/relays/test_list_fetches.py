"""A key's whole lists are asked for only in the first REQ that names it on a configured
relay; every other key's only from the relay's cursor, and kind 3 only of follows-only keys
(issue 34, item 2): the cost of one registration must not grow with the keys already in its
shard. The bookkeeping in isolation (`RelaySubscriptions`); bench/lists.py measures the bytes
a relay sends."""

from __future__ import annotations

from sigil_push.relays.nip11 import RelayLimits
from sigil_push.relays.subscriptions import RelaySubscriptions, Request

KEYS = [f"{i:064x}" for i in range(1, 300)]
FULL, CAUGHT_UP, LISTS_SINCE = 100, 200, 300


def _lists(request: Request) -> list[dict[str, object]]:
    return [f for f in request.filters if "authors" in f]


def _live(subs: RelaySubscriptions, requests: list[Request]) -> None:
    for request in requests:
        if request.sub_id:
            subs.eose(request.sub_id)


def test_a_new_key_gets_its_whole_lists_and_the_others_only_newer_ones() -> None:
    subs = RelaySubscriptions(keys_per_filter=500, with_lists=True)
    for key in KEYS[:200]:
        subs.add(key)
    [first] = subs.due(FULL, CAUGHT_UP, LISTS_SINCE)
    assert _lists(first) == [{"kinds": [10050, 10002, 10000], "authors": sorted(KEYS[:200])}]
    _live(subs, [first])
    assert subs.live and subs.lists_new == set()

    subs.follows.update({KEYS[0], KEYS[200]})
    subs.add(KEYS[200])
    [again] = subs.due(FULL, CAUGHT_UP, LISTS_SINCE)
    assert _lists(again) == [
        {"kinds": [10050, 10002, 10000], "authors": sorted(KEYS[:200]), "since": LISTS_SINCE},
        {"kinds": [10050, 10002, 10000], "authors": [KEYS[200]]},
        {"kinds": [3], "authors": [KEYS[0]], "since": LISTS_SINCE},
        {"kinds": [3], "authors": [KEYS[200]]},
    ]
    # cut short before its EOSE: the next REQ asks for the new key's whole lists again
    subs.connection_lost()
    [retry] = subs.due(FULL, CAUGHT_UP, LISTS_SINCE)
    assert {"kinds": [10050, 10002, 10000], "authors": [KEYS[200]]} in _lists(retry)
    _live(subs, [retry])
    assert subs.lists_new == set()


def test_keys_moved_between_shards_are_not_new() -> None:
    """A relay's NIP-11 limits repack every shard: its keys' lists are not asked for whole."""
    subs = RelaySubscriptions(keys_per_filter=500, with_lists=True)
    for key in KEYS[:10]:
        subs.add(key)
    _live(subs, subs.due(FULL, CAUGHT_UP, LISTS_SINCE))
    subs.apply_limits(RelayLimits(max_message_length=512 + 3 * 67 * 3))
    for request in subs.due(FULL, CAUGHT_UP, LISTS_SINCE):
        assert all("since" in f for f in _lists(request)), request


def test_a_key_that_turns_follows_only_gets_its_whole_kind_3() -> None:
    subs = RelaySubscriptions(keys_per_filter=500, with_lists=True)
    for key in KEYS[:5]:
        subs.add(key)
    _live(subs, subs.due(FULL, CAUGHT_UP, LISTS_SINCE))
    subs.follows.add(KEYS[3])
    assert subs.contacts_changed(KEYS[3], True)
    [request] = subs.due(FULL, CAUGHT_UP, LISTS_SINCE)
    assert {"kinds": [3], "authors": [KEYS[3]]} in _lists(request)
    _live(subs, [request])
    subs.follows.discard(KEYS[3])
    assert subs.contacts_changed(KEYS[3], False)
    [request] = subs.due(FULL, CAUGHT_UP, LISTS_SINCE)
    assert all(f["kinds"] != [3] for f in _lists(request))


def test_one_room_for_lists_merges_them() -> None:
    subs = RelaySubscriptions(keys_per_filter=500, with_lists=True)
    subs.apply_limits(RelayLimits(max_filters=2))
    for key in KEYS[:3]:
        subs.add(key)
    subs.follows.add(KEYS[1])
    [request] = subs.due(FULL, CAUGHT_UP, LISTS_SINCE)
    assert _lists(request) == [{"kinds": [10050, 10002, 10000, 3], "authors": sorted(KEYS[:3])}]
    _live(subs, [request])
    subs.add(KEYS[3], new=False)
    [request] = subs.due(FULL, CAUGHT_UP, LISTS_SINCE)
    assert _lists(request)[0]["since"] == LISTS_SINCE


def test_a_firehose_names_no_key() -> None:
    subs = RelaySubscriptions(keys_per_filter=500, with_lists=True)
    subs.set_firehose(True)
    for key in KEYS[:3]:
        subs.add(key)
    for request in subs.due(FULL, CAUGHT_UP, LISTS_SINCE):
        assert all("authors" not in f and "#p" not in f for f in request.filters)
    assert subs.lists_new == set()
