"""Iris subscriptions in the store, on each engine: targets are device rows (one per endpoint
and subscriber, however many subscriptions name it), and the schema keeps the two consistent
whichever side goes first (migration 0018's trigger)."""

from __future__ import annotations

import asyncio

import pytest

from sigil_push.store.errors import NotYours, TargetTaken, TooManySubscriptions
from sigil_push.store.factory import PostgresStore, SqliteStore
from sigil_push.store.interface import IrisTarget
from testkit.stores import sql_of

ALICE, BOB = "a" * 64, "b" * 64
ONE = IrisTarget("webpush", "https://push.example/one", "BKEY1", "AUTH1")
TWO = IrisTarget("webpush", "https://push.example/two", "BKEY2", "AUTH2")
HOOK = IrisTarget("webhook", "https://hooks.example/x", None, None)


async def _device_tokens(store: SqliteStore | PostgresStore) -> list[str]:
    devices = [await store.devices.by_id(i) for s in await store.iris.all() for i in s.device_ids]
    return sorted({d.token for d in devices if d is not None})


async def test_an_endpoint_in_two_subscriptions_is_one_device_and_outlives_one_of_them(
    store: SqliteStore | PostgresStore,
) -> None:
    iris = store.iris
    assert await iris.put("s1", ALICE, '{"filter":{"#p":["x"]}}', [ONE], 20)
    assert await iris.put("s2", ALICE, '{"filter":{"authors":["y"]}}', [ONE, HOOK], 20)
    first, second = await iris.get("s1"), await iris.get("s2")
    assert first is not None and second is not None
    assert first.document == '{"filter":{"#p":["x"]}}'
    assert set(first.device_ids) < set(second.device_ids) and len(second.device_ids) == 2
    device = await store.devices.by_id(first.device_ids[0])
    assert device is not None and device.payload == "iris" and device.platform == "webpush"
    assert device.webpush_keys is not None and device.webpush_keys.p256dh == "BKEY1"
    assert await store.devices.of_pubkey(ALICE) == [], "not a registration"
    assert await iris.delete("s2", ALICE)
    assert await _device_tokens(store) == [ONE.token], "the webhook no one names is gone"
    assert [s.id for s in await iris.of_pubkey(ALICE)] == ["s1"]


async def test_a_replaced_subscription_keeps_its_id_and_drops_targets_it_no_longer_names(
    store: SqliteStore | PostgresStore,
) -> None:
    iris = store.iris
    assert await iris.put("s1", ALICE, "{}", [ONE], 20)
    rotated = IrisTarget("webpush", ONE.token, "BKEY9", "AUTH9")
    assert not await iris.put("s1", ALICE, '{"v":2}', [rotated, TWO], 20)
    stored = await iris.get("s1")
    assert stored is not None and stored.document == '{"v":2}'
    keys = [(await store.devices.by_id(i)) for i in stored.device_ids]
    assert sorted((d.token, d.webpush_keys.p256dh) for d in keys if d and d.webpush_keys) == [
        (ONE.token, "BKEY9"), (TWO.token, "BKEY2"),
    ]
    assert not await iris.put("s1", ALICE, '{"v":3}', [TWO], 20)
    assert await _device_tokens(store) == [TWO.token]


async def test_a_dead_endpoint_leaves_every_subscription_and_one_left_without_targets_goes(
    store: SqliteStore | PostgresStore,
) -> None:
    """404/410 from an endpoint: delivery forgets the device (every subscriber's row of it);
    a subscription with other targets stays, one with none left is deleted."""
    iris = store.iris
    await iris.put("only", ALICE, "{}", [ONE], 20)
    await iris.put("both", ALICE, "{}", [ONE, TWO], 20)
    await iris.put("bobs", BOB, "{}", [ONE], 20)
    only = await iris.get("only")
    assert only is not None
    await store.devices.forget(only.device_ids[0])
    assert await iris.get("only") is None and await iris.get("bobs") is None
    both = await iris.get("both")
    assert both is not None and len(both.device_ids) == 1
    assert await _device_tokens(store) == [TWO.token]


async def test_ownership_the_limit_and_registration_tokens_are_enforced(
    store: SqliteStore | PostgresStore,
) -> None:
    iris = store.iris
    assert await iris.put("s1", ALICE, "{}", [ONE], 2)
    with pytest.raises(NotYours):
        await iris.put("s1", BOB, "{}", [ONE], 2)
    assert not await iris.delete("s1", BOB)
    assert await iris.put("s2", ALICE, "{}", [ONE], 2)
    with pytest.raises(TooManySubscriptions):
        await iris.put("s3", ALICE, "{}", [ONE], 2)
    assert not await iris.put("s2", ALICE, "{}", [TWO], 2), "replacing is not adding"
    await store.devices.register(BOB, "unifiedpush", TWO.token, "opaque", [], None, 10)
    with pytest.raises(TargetTaken):
        await iris.put("b1", BOB, "{}", [TWO], 2)
    with pytest.raises(TargetTaken):
        await store.devices.register(ALICE, "unifiedpush", ONE.token, "opaque", [], None, 10)
    assert [s.id for s in await iris.of_pubkey(BOB)] == []


async def test_every_write_is_told_to_listeners_here_and_on_other_workers(
    store: SqliteStore | PostgresStore,
) -> None:
    """A created, replaced or deleted subscription is told to this store's listeners (the
    bridge of this process) and, on PostgreSQL, to every other worker's (NOTIFY): each
    worker's bridge then reads the subscriber's subscriptions again. A refused write and a
    deletion of nothing tell no one."""
    from testkit.bridge_harness import eventually
    from testkit.stores import open_test_store

    heard: list[str] = []
    store.iris.add_listener(heard.append)
    other = None
    elsewhere: list[str] = []
    if isinstance(store, PostgresStore):
        other = await open_test_store(store.url, "w2")
        other.iris.add_listener(elsewhere.append)
    try:
        assert await store.iris.put("s1", ALICE, "{}", [ONE], 20)
        assert not await store.iris.put("s1", ALICE, '{"v":2}', [ONE], 20)
        with pytest.raises(NotYours):
            await store.iris.put("s1", BOB, "{}", [TWO], 20)
        assert not await store.iris.delete("s1", BOB)
        assert await store.iris.delete("s1", ALICE)
        assert heard == [ALICE, ALICE, ALICE]
        if other is not None:
            await eventually(lambda: len(elsewhere) == 3, "the other worker heard every write")
            assert elsewhere == [ALICE, ALICE, ALICE]
    finally:
        if other is not None:
            await other.close()


async def test_targets_unlinked_at_once_leave_no_subscription_or_device_behind(
    store: SqliteStore | PostgresStore,
) -> None:
    """Two unlinks at once, each the other's last companion: APNs and FCM both calling a
    subscription's tokens dead (two forgets, on two connections on PostgreSQL), or Iris
    deleting its two subscriptions of one endpoint together. Each unlink's check for what is
    left must see the other's, or the subscription (the device) outlives its last target (its
    last subscription): a subscription pushing nowhere yet counting against its owner's 20."""
    iris = store.iris
    for attempt in range(12):
        apns = IrisTarget("ios", f"{attempt:064x}", None, None)
        fcm = IrisTarget("android", f"fcm-token-{attempt:040d}", None, None)
        assert await iris.put(f"s{attempt}", ALICE, "{}", [apns, fcm], 20)
        assert await iris.put(f"t{attempt}", ALICE, "{}", [fcm, apns], 20)
        stored = await iris.get(f"s{attempt}")
        assert stored is not None and len(stored.device_ids) == 2
        await asyncio.gather(*(store.devices.forget(i) for i in stored.device_ids))
        assert await iris.of_pubkey(ALICE) == [], f"attempt {attempt}: a subscription left"

        shared = IrisTarget("webpush", f"https://push.example/{attempt}", "BKEY", "AUTH")
        assert await iris.put(f"u{attempt}", ALICE, "{}", [shared], 20)
        assert await iris.put(f"v{attempt}", ALICE, "{}", [shared], 20)
        await asyncio.gather(iris.delete(f"u{attempt}", ALICE), iris.delete(f"v{attempt}", ALICE))
        assert await _device_tokens(store) == []
        rows = await sql_of(store).execute_fetchall(
            "SELECT COUNT(*) FROM devices WHERE payload = 'iris'")
        assert rows[0][0] == 0, f"attempt {attempt}: a device left without subscriptions"
