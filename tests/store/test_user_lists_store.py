"""The users' lists and presence lapses in the store (issue 20), on both engines: newest list
wins, a 100,000-tag list is cut to 10,000 keys and counted, the kind 4 author checks, and the
lapse wakeup claimed exactly once by workers racing for it on their own connections.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from sigil_push.bridge.user_lists import MAX_LIST_ENTRIES, MAX_WORD_CHARS, MAX_WORDS, user_list_of
from sigil_push.config import parse_config
from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.factory import PostgresStore, SqliteStore, connect_bridge
from sigil_push.store.interface import BookkeepingOp, BridgeConnection, IrisTarget
from sigil_push.store.preferences import MAX_DEFERRED_PER_PAIR, UserList
from sigil_push.store.records import Device, PreferenceChange, pack_keys
from testkit.rules import dm_checks, reason_of
from testkit.stores import fetch


def _key() -> str:
    return os.urandom(32).hex()


def _list(owner: SecretKey, kind: int, keys: list[str], created_at: int) -> Event:
    return sign_event(owner, kind, "", [["p", key] for key in keys], created_at)


async def _link(tmp_path: Path, database: str) -> BridgeConnection:
    return await connect_bridge(parse_config({"server": {"database": database}},
                                             tmp_path / "relays.toml"))


def test_a_list_of_100000_tags_keeps_10000_keys_and_counts_the_rest() -> None:
    """100,000 `p`, 100,000 `e` and 100,000 `word` tags: each kept to its cap, the rest
    counted as truncated; malformed tags are skipped."""
    owner = SecretKey.generate()
    keys = [f"{n:064x}" for n in range(100_000)]
    tags = [["p", key] for key in keys] + [["p", "not hex"], ["e", "not hex"], ["p"]]
    tags += [["e", key] for key in keys] + [["word", f"Word{n}"] for n in range(100_000)]
    tags += [["word", "x" * (MAX_WORD_CHARS + 1)]]
    event = sign_event(owner, 10000, "", tags, int(time.time()))
    truncated = REGISTRY.get_sample_value("sigil_push_bridge_user_lists_total",
                                          {"outcome": "truncated"}) or 0.0
    reduced = user_list_of(event)
    assert reduced.entry_count == 2 * MAX_LIST_ENTRIES + MAX_WORDS
    assert len(reduced.entries) == 32 * MAX_LIST_ENTRIES
    assert len(reduced.threads) == 32 * MAX_LIST_ENTRIES
    assert reduced.words.split("\n")[:2] == ["word0", "word1"]
    assert len(reduced.words.split("\n")) == MAX_WORDS
    assert reduced.truncated == 2 * (100_000 - MAX_LIST_ENTRIES) + 100_000 - MAX_WORDS + 1
    assert REGISTRY.get_sample_value("sigil_push_bridge_user_lists_total",
                                     {"outcome": "truncated"}) == truncated + 1


async def test_the_newest_list_wins_then_the_lowest_id(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    owner = SecretKey.generate()
    await store.devices.register(owner.public_key_hex, "ios", _key(), "opaque", (), None, 0)
    link = await _link(tmp_path, database)
    lists = link.lists
    try:
        now = int(time.time())
        first = user_list_of(_list(owner, 3, [_key()], now))
        assert await lists.save([first]) == [first]
        older = user_list_of(_list(owner, 3, [_key()], now - 1))
        assert await lists.save([older]) == []
        same_time = [user_list_of(_list(owner, 3, [_key(), _key()], now)) for _ in range(3)]
        taken = await lists.save(same_time)
        lowest = min([first, *same_time], key=lambda item: item.event_id)
        stored = fetch(database, "SELECT event_id, entry_count FROM user_lists WHERE pubkey = ?",
                       (owner.public_key_hex,))
        assert stored == [(lowest.event_id, lowest.entry_count)]
        assert (lowest in taken) == (lowest is not first)
    finally:
        await link.close()


async def test_a_list_of_a_key_without_a_pair_is_not_stored(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """A list that arrives after its key's last pair left (in flight while it unregistered)
    is not stored: nothing would ever delete it (issue 34, item 6)."""
    owner = SecretKey.generate()
    link = await _link(tmp_path, database)
    try:
        gone = user_list_of(_list(owner, 3, [_key()], int(time.time())))
        assert await link.lists.save([gone]) == []
        assert fetch(database, "SELECT kind FROM user_lists WHERE pubkey = ?",
                     (owner.public_key_hex,)) == []
    finally:
        await link.close()


async def test_a_keys_lists_are_deleted_with_its_last_device_row_but_not_once_it_has_one_again(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """Issue 34, item 6: the bridge's `DELETE_USER_LISTS` for a key that left deletes its
    kind 3 and 10000; the same write for a key registered again meanwhile (the bookkeeping is
    queued behind the batch) keeps them, as for a key whose Iris subscription's target reads
    them (no pair, but a device row) until its last subscription is deleted, and other keys'
    lists are never touched."""
    gone, back, other = SecretKey.generate(), SecretKey.generate(), SecretKey.generate()
    subscriber = SecretKey.generate()
    tokens = {}
    for owner in (gone, back, other):
        tokens[owner.public_key_hex] = _key()
        await store.devices.register(owner.public_key_hex, "ios", tokens[owner.public_key_hex],
                                     "opaque", (), None, 0)
    target = IrisTarget("webpush", "https://push.example/lists", "BKEY", "AUTH")
    await store.iris.put("lists", subscriber.public_key_hex, "{}", [target], 10)
    owners = (gone, back, other, subscriber)
    link = await _link(tmp_path, database)
    try:
        now = int(time.time())
        async with link.transaction():
            saved = await link.lists.save([user_list_of(_list(owner, kind, [_key()], now))
                                           for owner in owners for kind in (3, 10000)])
        assert len(saved) == 2 * len(owners)
        for owner in (gone, back):
            await store.devices.unregister(owner.public_key_hex, tokens[owner.public_key_hex])
        await store.devices.register(back.public_key_hex, "ios", _key(), "opaque", (), None, 0)
        async with link.transaction():
            await link.state.apply(BookkeepingOp.DELETE_USER_LISTS, [
                (gone.public_key_hex,), (back.public_key_hex,), (subscriber.public_key_hex,)
            ])

        def kinds(owner: SecretKey) -> list[int]:
            return sorted(row[0] for row in fetch(
                database, "SELECT kind FROM user_lists WHERE pubkey = ?", (owner.public_key_hex,)
            ))

        assert kinds(gone) == []
        assert kinds(back) == [3, 10000]
        assert kinds(other) == [3, 10000]
        assert kinds(subscriber) == [3, 10000]

        # the subscriber's last subscription deleted: its target's device row goes with it
        # (0018's trigger), and the same write then deletes its lists
        assert await store.iris.delete("lists", subscriber.public_key_hex)
        async with link.transaction():
            await link.state.apply(BookkeepingOp.DELETE_USER_LISTS,
                                   [(subscriber.public_key_hex,), (back.public_key_hex,)])
        assert kinds(subscriber) == []
        assert kinds(back) == [3, 10000]
    finally:
        await link.close()


async def test_kind_4_authors_are_checked_against_the_lists_and_the_private_mutes(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    owner = SecretKey.generate()
    pubkey = owner.public_key_hex
    muted, listed, friend, stranger = _key(), _key(), _key(), _key()
    quiet = (await store.devices.register(pubkey, "ios", _key(), "opaque", (), None, 0)).device
    follows = (await store.devices.register(pubkey, "ios", _key(), "opaque", (), None, 0)).device
    plain = (await store.devices.register(pubkey, "ios", _key(), "opaque", (), None, 0)).device
    await store.devices.set_preferences(pubkey, quiet.token,
                                        PreferenceChange(muted=pack_keys([muted]), muted_count=1))
    await store.devices.set_preferences(pubkey, follows.token, PreferenceChange(senders="follows"))
    link = await _link(tmp_path, database)
    lists = link.lists
    try:
        now = int(time.time())
        await lists.save([user_list_of(_list(owner, 10000, [listed], now)),
                          user_list_of(_list(owner, 3, [friend, listed], now))])
        devices = {d.id: d for d in await store.devices.of_pubkey(pubkey)}
        rules = devices[follows.id].rules
        assert rules is not None and rules.follows_known and rules.mute_list
        every: list[Device] = list(devices.values())
        # one call answers a whole batch's checks
        assert await lists.blocked(dm_checks([(muted, every), (listed, every), (friend, every),
                                              (stranger, every), (stranger, [devices[quiet.id]])]),
                                   reason_of) == [
            {quiet.id: "muted", follows.id: "not_followed"},
            {quiet.id: "muted", follows.id: "muted", plain.id: "muted"},
            {},
            {follows.id: "not_followed"},
            {},
        ]
    finally:
        await link.close()


async def test_the_list_flags_follow_the_lists_on_pairs_written_before_and_after(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """The device read takes the npub's lists from its pairs' own rows (`list_flags`): a
    list stored sets them on the npub's pairs already there, a pair registered later gets
    them from the stored lists, a kind 10000 without keys mutes nobody, and other npubs'
    pairs are left alone."""
    owner, other = SecretKey.generate(), SecretKey.generate()
    pubkey = owner.public_key_hex
    before = (await store.devices.register(pubkey, "ios", _key(), "opaque", (), None, 0)).device
    bystander = (await store.devices.register(other.public_key_hex, "ios", _key(), "opaque", (),
                                              None, 0)).device
    link = await _link(tmp_path, database)
    try:
        now = int(time.time())
        await link.lists.save([user_list_of(_list(owner, 10000, [], now))])
        assert (await store.devices.by_id(before.id)).rules is None  # type: ignore[union-attr]
        await link.lists.save([user_list_of(_list(owner, 10000, [_key()], now + 1)),
                               user_list_of(_list(owner, 3, [_key()], now))])
        after = (await store.devices.register(pubkey, "ios", _key(), "opaque", (), None, 0)).device
        for device in await store.devices.of_pubkey(pubkey):
            assert device.rules is not None, device.id
            assert device.rules.mute_list and device.rules.follows_known, device.id
        assert {d.id for d in await store.devices.of_pubkey(pubkey)} == {before.id, after.id}
        assert (await store.devices.by_id(bystander.id)).rules is None  # type: ignore[union-attr]
    finally:
        await link.close()


@pytest.mark.parametrize("workers", [4])
async def test_a_deferred_wakeup_is_claimed_once_by_racing_workers(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path, workers: int
) -> None:
    """Several connections (workers) claim the same lapsed presence's held events at once,
    each in its own transaction, and again afterwards: one claim in all, and the presence is
    cleared."""
    owner = SecretKey.generate()
    device = (await store.devices.register(owner.public_key_hex, "ios", _key(), "opaque", (),
                                           None, 0)).device
    now = int(time.time())
    await store.devices.set_presence(owner.public_key_hex, device.token, now + 60)
    links = [await _link(tmp_path, database) for _ in range(workers)]
    try:
        event_id = _key()
        async with links[0].transaction():
            await links[0].lists.defer(
                [(device.id, "present", event_id, "wss://r.example", None, None, now)], now
            )

        async def claim(link: BridgeConnection) -> int:
            async with link.transaction():
                claimed = await link.lists.claim_deferred(now + 61)
                await asyncio.sleep(0.05)  # hold the transaction open while the others try
            return len(claimed)

        first = await asyncio.gather(*(claim(link) for link in links))
        again = await asyncio.gather(*(claim(link) for link in links))
        assert sorted(first) == [0] * (workers - 1) + [1]
        assert again == [0] * workers
        assert fetch(database, "SELECT present_until FROM devices WHERE id = ?",
                     (device.id,)) == [(None,)]
        assert fetch(database, "SELECT COUNT(*) FROM deferred_wakeups") == [(0,)]
    finally:
        for link in links:
            await link.close()


async def test_a_presence_ended_or_not_yet_lapsed_is_not_claimed(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """A presence the app ended drops its held events; one still running keeps them; a quiet
    window's events are due at its end; a pair keeps only its newest held events."""
    owner = SecretKey.generate()
    pubkey = owner.public_key_hex
    ended = (await store.devices.register(pubkey, "ios", _key(), "opaque", (), None, 0)).device
    running = (await store.devices.register(pubkey, "ios", _key(), "opaque", (), None, 0)).device
    now = int(time.time())
    for device in (ended, running):
        await store.devices.set_presence(pubkey, device.token, now + 60)
    link = await _link(tmp_path, database)
    try:
        lists = link.lists
        quiet = [(running.id, "quiet", _key(), "wss://r", None, now + 40, now - i)
                 for i in range(MAX_DEFERRED_PER_PAIR + 5)]
        await lists.defer([(ended.id, "present", _key(), "wss://r", None, None, now),
                           (running.id, "present", _key(), "wss://r", _key(), None, now),
                           *quiet], now)
        await store.devices.set_presence(pubkey, ended.token, None)
        assert await lists.claim_deferred(now + 30) == []
        due = await lists.claim_deferred(now + 45)
        assert [row[2] for row in due] == sorted(row[2] for row in quiet[:MAX_DEFERRED_PER_PAIR])
        [lapsed] = await lists.claim_deferred(now + 61)
        assert lapsed[:2] == (running.id, "present")
        await lists.enqueue_deferred([(running.id, lapsed[2], lapsed[3])], now * 1000)
        assert [row[0] for row in fetch(database, "SELECT device_id FROM outbox")] == [running.id]
    finally:
        await link.close()


def test_user_list_rows_are_what_ingest_reduced() -> None:
    """The stored form: pubkey, kind, created_at, id, packed keys, count, truncated."""
    owner = SecretKey.generate()
    keys = [_key(), _key(), _key()]
    event = _list(owner, 3, [*keys, keys[0]], 1_700_000_000)
    assert user_list_of(event) == UserList(owner.public_key_hex, 3, 1_700_000_000, event.id,
                                           pack_keys(keys), 3, 0, b"", "")
