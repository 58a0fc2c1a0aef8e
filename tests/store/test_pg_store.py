"""The store interface, checked on both engines (a real SQLite file, a real PostgreSQL):
the outbox, seen ids and device registrations behave the same whatever is underneath, and
on PostgreSQL two workers sharing the database never take the same wakeup."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import pytest

from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.errors import TooManyDevices
from sigil_push.store.factory import PostgresStore, SqliteStore
from sigil_push.store.records import Device
from sigil_push.store.seen import SeenEvents
from testkit.deadlines import scaled
from testkit.stores import open_test_store, seen_rows

Store = SqliteStore | PostgresStore
NOW = 1_700_000_000_000


def _event(text: str = "x") -> Event:
    return sign_event(SecretKey.generate(), 4, text, [["p", "a" * 64]])


async def _devices(store: Store, count: int, payload: str = "opaque") -> list[Device]:
    pubkey = secrets.token_hex(32)
    return [
        (await store.devices.register(
            pubkey, "ios", secrets.token_hex(32), payload, (), None, 0
        )).device
        for _ in range(count)
    ]


async def test_outbox_enqueues_each_event_device_pair_once(
    store: Store, store_backend: str
) -> None:
    """One wakeup per device. A (device, event) queued again is skipped on PostgreSQL, where
    workers overlapping on a shard may both hand the event over; SQLite's one writer hands
    each event over once (tests/bridge/test_bridge_units.py: exactly once through the committer),
    so it keeps no index keyed by the random event id (migration 0014)."""
    devices = await _devices(store, 2, payload="event")
    event = _event()
    assert await store.outbox.enqueue(event, "wss://a", NOW, devices) == 2
    if store_backend == "postgres":
        assert await store.outbox.enqueue(event, "wss://b", NOW, devices) == 0
    assert await store.outbox.depth() == 2
    await store.outbox.resume(NOW)
    due = await store.outbox.due(NOW, 10)
    assert sorted(w.device_id for w in due) == sorted(d.id for d in devices)
    assert all(w.relay == "wss://a" and w.event_json and event.id in w.event_json for w in due)
    assert await store.outbox.oldest_first_seen_ms() == NOW


async def test_outbox_ids_and_so_collapse_ids_are_never_reused(store: Store) -> None:
    """A push's apns-collapse-id is keyed on its first row's id: an id handed out again after
    the outbox emptied (SQLite's max(id) + 1 without AUTOINCREMENT) made unrelated wakeups
    share a collapse id, so a phone replaced one notification with the next."""
    outbox = store.outbox
    await outbox.resume(NOW)
    collapse_ids = set()
    for _ in range(3):
        await outbox.enqueue(_event(), "wss://a", NOW, await _devices(store, 1))
        [wakeup] = await outbox.due(NOW, 10)
        await outbox.complete([wakeup.id])  # delivered: the outbox is empty again
        collapse_ids.add(outbox.collapse_id(wakeup.id))
    assert len(collapse_ids) == 3


async def test_outbox_claim_reschedule_complete_and_crash_resume(store: Store) -> None:
    outbox = store.outbox
    devices = await _devices(store, 3)
    await outbox.enqueue(_event(), "wss://a", NOW, devices)
    await outbox.resume(NOW)
    assert len(outbox.collapse_id(1)) == 32 and outbox.collapse_id(1) == outbox.collapse_id(1)
    first, second, third = await outbox.due(NOW, 10)
    await outbox.hold([third.id], NOW + 5_000)
    assert await outbox.due(NOW + 1_000, 10) == []
    assert await outbox.next_due_ms() is not None
    await outbox.complete([first.id])
    assert await outbox.depth() == 2
    # a claim whose push is not live any more comes back; a live one stays
    assert await outbox.release_claims(NOW + 1, live={second.id}) == 0
    assert await outbox.release_claims(NOW + 1, live=set()) == 1
    later = await outbox.due(NOW + 5_000, 10)
    assert sorted(w.id for w in later) == sorted([second.id, third.id])
    # the sent one counts an attempt, the one held back without a send does not
    assert {w.id: w.attempts for w in later} == {second.id: 1, third.id: 0}
    # a crash with claims held: the next start makes them due again at once
    restarted = await open_test_store(_url(store), "after-crash")
    try:
        assert await restarted.outbox.resume(NOW + 6_000) >= 1
        assert second.id in {w.id for w in await restarted.outbox.due(NOW + 6_000, 10)}
    finally:
        await restarted.close()


async def test_outbox_due_filters_by_platform(store: Store) -> None:
    ios = await _devices(store, 1)
    android = (await store.devices.register(
        secrets.token_hex(32), "android", "fcm-token-" + secrets.token_hex(8), "opaque", (),
        None, 0,
    )).device
    await store.outbox.enqueue(_event(), "wss://a", NOW, [*ios, android])
    await store.outbox.resume(NOW)
    only = await store.outbox.due(NOW, 10, ["android"])
    assert [w.device.platform for w in only] == ["android"]


async def test_seen_ids_survive_a_restart_and_are_pruned_after_retention(store: Store) -> None:
    ids = [secrets.token_hex(32) for _ in range(3)]
    seen = SeenEvents(seen_rows(store), retention_seconds=1000, cache_size=2)
    await seen.lookup(ids)
    pending: dict[str, tuple[str, ...]] = {}
    for event_id in ids:
        assert seen.first_delivery(event_id, "wss://a", pending) == (True, True)
    seen.remember(pending)
    await seen.save([(i, ("wss://a",), 1_000_000, 1000) for i in ids], [])
    await seen.save([(ids[0], ("wss://z",), 1_000_000, 1000)], [])  # a second worker's late copy
    restarted = SeenEvents(seen_rows(store), retention_seconds=1000, cache_size=10)
    await restarted.load()
    assert restarted.delivered_by(ids[0], "wss://a")
    assert not restarted.delivered_by(ids[0], "wss://z")
    await restarted.save([], [(ids[0], "wss://b")])
    again = SeenEvents(seen_rows(store), retention_seconds=1000, cache_size=10)
    await again.lookup([ids[0]])
    assert again.delivered_by(ids[0], "wss://b")
    assert await again.prune(now=1999) == 0
    assert await again.prune(now=2001) == 3


async def test_seen_lookup_finds_exactly_the_saved_ids_in_batches_of_any_size(
    store: Store,
) -> None:
    """Lookups are padded to a few statement sizes and split in chunks of 500: the ids found
    are the saved ones, whatever the number asked for, and no unknown id is taken as seen."""
    saved = sorted(secrets.token_hex(32) for _ in range(700))
    writer = SeenEvents(seen_rows(store), retention_seconds=1000, cache_size=10)
    await writer.save([(i, ("wss://a",), 1_000_000, 1000) for i in saved], [])
    for known, unknown in ((1, 0), (0, 3), (9, 4), (650, 13)):
        asked = saved[:known] + [secrets.token_hex(32) for _ in range(unknown)]
        reader = SeenEvents(seen_rows(store), retention_seconds=1000, cache_size=1000)
        await reader.lookup(asked)
        assert [i for i in asked if reader.known(i)] == saved[:known]
        assert len(reader) == known


async def test_device_limit_holds_under_concurrent_registrations(store: Store) -> None:
    pubkey = secrets.token_hex(32)

    async def attempt() -> bool:
        try:
            await store.devices.register(pubkey, "ios", secrets.token_hex(32), "opaque", (), None, 5)
            return True
        except TooManyDevices:
            return False

    assert sum(await asyncio.gather(*(attempt() for _ in range(20)))) == 5
    assert len(await store.devices.of_pubkey(pubkey)) == 5
    assert await store.devices.watched_keys() == {pubkey: ()}


def _url(store: Store) -> str:
    return store.url if isinstance(store, PostgresStore) else str(store.path)


async def test_one_token_registered_by_two_npubs_is_two_pairs(store: Store) -> None:
    alice, bob, token = secrets.token_hex(32), secrets.token_hex(32), secrets.token_hex(32)
    changed: list[str] = []
    store.devices.add_listener(changed.append)
    first = await store.devices.register(alice, "ios", token, "opaque", (), None, 10)
    second = await store.devices.register(bob, "ios", token, "opaque", (), None, 10)
    assert first.created and second.created
    assert changed == [alice, bob]
    assert [d.token for d in await store.devices.of_pubkey(alice)] == [token]
    assert await store.devices.unregister(bob, token) == 1
    assert [d.token for d in await store.devices.of_pubkey(alice)] == [token]
    await store.devices.register(bob, "ios", token, "opaque", (), None, 10)
    # a dead token takes every pair with it
    gone = await store.devices.forget(first.device.id)
    assert gone is not None and gone.pubkey == alice
    assert await store.devices.count() == 0


async def test_two_postgres_workers_never_take_the_same_wakeup(
    store: Store, store_backend: str
) -> None:
    if store_backend != "postgres":
        pytest.skip("one SQLite file has one delivering process")
    devices = await _devices(store, 200)
    await store.outbox.enqueue(_event(), "wss://a", NOW, devices)
    other = await open_test_store(_url(store), "w2")
    try:
        await asyncio.gather(store.outbox.resume(NOW), other.outbox.resume(NOW))
        taken: list[list[int]] = [[], []]

        async def drain(index: int, worker: Store) -> None:
            while batch := await worker.outbox.due(NOW, 7):
                ids = [w.id for w in batch]
                taken[index].extend(ids)
                await worker.outbox.complete(ids)

        await asyncio.gather(drain(0, store), drain(1, other))
        assert not set(taken[0]) & set(taken[1])
        assert len(taken[0]) + len(taken[1]) == 200 and taken[0] and taken[1]
        assert await store.outbox.depth() == 0
    finally:
        await other.close()


async def test_a_dead_workers_claims_lapse_and_another_worker_sends_them(
    store: Store, store_backend: str
) -> None:
    if store_backend != "postgres":
        pytest.skip("claims lapse only between PostgreSQL workers")
    devices = await _devices(store, 3)
    await store.outbox.enqueue(_event(), "wss://a", NOW, devices)
    other = await open_test_store(_url(store), "w2")
    try:
        await store.outbox.resume(NOW)
        await other.outbox.resume(NOW)
        held = await store.outbox.due(NOW, 10)
        assert await other.outbox.due(NOW + 1_000, 10) == []
        # the first worker never finishes; its claims last 60 s in these stores
        retaken = await other.outbox.due(NOW + 60_000, 10)
        assert sorted(w.id for w in retaken) == sorted(w.id for w in held)
        assert {w.attempts for w in retaken} == {1}
        await store.outbox.complete([w.id for w in held])  # the late worker cannot delete them
        assert await store.outbox.depth() == 3
    finally:
        await other.close()


async def test_attempts_count_sends_not_holds_nor_reads(store: Store) -> None:
    """`push.max_attempts` counts sends: a wakeup held back again and again (a coalescing
    window, a rate limit) never runs out of attempts, and a retried one counts each send, on
    both engines (PostgreSQL counts in `due` and undoes the count in `hold`)."""
    outbox = store.outbox
    await outbox.enqueue(_event(), "wss://a", NOW, await _devices(store, 2))
    await outbox.resume(NOW)
    for round_ in range(3):
        now = NOW + round_ * 1_000
        sent, held = await outbox.due(now, 10)
        assert (sent.attempts, held.attempts) == (round_, 0)
        await outbox.hold([held.id], now + 1_000)
        await outbox.reschedule([sent.id], now + 1_000)  # a provider said: retry later
    assert await outbox.depth() == 2


async def test_due_reserves_its_rows_and_counts_the_attempt_on_both_engines(store: Store) -> None:
    """`due` claims what it returns and counts the attempt in the same statement (SQLite's
    UPDATE ... RETURNING, PostgreSQL's reserving UPDATE): a second `due` does not see the
    rows, a reservation nobody settles comes back through `release_claims` one attempt on,
    and `hold` gives rows back with the count undone."""
    outbox = store.outbox
    await outbox.enqueue(_event(), "wss://a", NOW, await _devices(store, 2))
    await outbox.resume(NOW)
    reserved = await outbox.due(NOW, 10)
    assert [w.attempts for w in reserved] == [0, 0]
    assert [w.id for w in reserved] == sorted(w.id for w in reserved), "oldest schedule first"
    assert await outbox.due(NOW, 10) == [], "reserved rows are not handed out twice"
    # nothing sent them and no push holds them: the lapsed reservation counted an attempt
    assert await outbox.release_claims(NOW + 1, live=set()) == 2
    again = await outbox.due(NOW + 1, 10)
    assert sorted(w.id for w in again) == sorted(w.id for w in reserved)
    assert [w.attempts for w in again] == [1, 1]
    await outbox.hold([w.id for w in again], NOW + 2)
    assert await outbox.due(NOW + 1, 10) == [], "held until NOW + 2"
    assert [w.attempts for w in await outbox.due(NOW + 2, 10)] == [1, 1], "hold undid the count"


async def test_a_worker_killed_between_due_and_its_sends_leaves_rows_another_sends_once(
    store: Store, store_backend: str
) -> None:
    """A worker that reserved a batch and died before sending it:
    its reservation lapses, another worker takes the rows once, and the lost batch counts
    as an attempt (PostgreSQL counts in `due`; docs/operations.md)."""
    if store_backend != "postgres":
        pytest.skip("claims lapse only between PostgreSQL workers")
    await store.outbox.enqueue(_event(), "wss://a", NOW, await _devices(store, 3))
    other = await open_test_store(_url(store), "w2")
    third = await open_test_store(_url(store), "w3")
    try:
        await store.outbox.resume(NOW)
        reserved = await store.outbox.due(NOW, 10)  # and then the worker is gone
        assert len(reserved) == 3
        assert await other.outbox.due(NOW + 59_999, 10) == []
        taken = await asyncio.gather(
            other.outbox.due(NOW + 60_000, 10), third.outbox.due(NOW + 60_000, 10)
        )
        retaken = [w for batch in taken for w in batch]
        assert sorted(w.id for w in retaken) == sorted(w.id for w in reserved)
        assert {w.attempts for w in retaken} == {1}
        for worker, batch in zip((other, third), taken, strict=True):
            await worker.outbox.complete([w.id for w in batch])
        assert await store.outbox.depth() == 0
    finally:
        await other.close()
        await third.close()


async def _terminate(url: str, condition: str) -> int:
    import asyncpg

    admin = await asyncpg.connect(url)
    try:
        return int(await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            f" WHERE datname = current_database() AND pid <> pg_backend_pid() AND {condition}"
        ))
    finally:
        await admin.close()


async def test_registrations_reach_other_workers_also_after_their_connection_broke(
    store: Store, store_backend: str
) -> None:
    """A registration through one worker is told to another worker's listeners (the bridge
    there re-plans the key); when the listening connection is cut, it is opened again, and
    the worker is told it may have missed announcements meanwhile (`on_missed`: its shards'
    keys are read again), once per break."""
    if store_backend != "postgres":
        pytest.skip("one SQLite process hears its own registrations")
    import time

    from testkit.bridge_harness import eventually

    other = await open_test_store(_url(store), "w2")
    try:
        heard: list[str] = []
        missed: list[str] = []
        other.devices.add_listener(heard.append)
        other.devices.on_missed(lambda: missed.append("reload"))  # type: ignore[attr-defined]
        first = secrets.token_hex(32)
        await store.devices.register(first, "ios", secrets.token_hex(32), "opaque", (), None, 0)
        await eventually(lambda: first in heard, "the other worker heard the registration")
        assert await _terminate(_url(store), "query LIKE 'LISTEN%'") >= 1
        second = secrets.token_hex(32)
        deadline = time.monotonic() + scaled(30)
        while second not in heard and time.monotonic() < deadline:
            # a change announced before the listener is back is not heard: announce again
            await store.devices.register(second, "ios", "ab" * 32, "opaque", (), None, 0)
            await asyncio.sleep(0.2)
        assert second in heard
        assert missed == ["reload"]
    finally:
        await other.close()


async def test_the_bridge_connection_comes_back_after_the_server_dropped_it(
    database: str, store_backend: str, tmp_path: object
) -> None:
    if store_backend != "postgres":
        pytest.skip("a SQLite file has no connection to lose")
    from sigil_push.config import parse_config
    from sigil_push.store.errors import TRANSIENT_ERRORS
    from sigil_push.store.factory import connect_bridge

    config = parse_config({"server": {"database": database}}, tmp_path / "relays.toml")  # type: ignore[operator]
    link = await connect_bridge(config)
    try:
        before = await link.db.fetchval("SELECT pg_backend_pid()")
        assert await _terminate(database, f"pid = {before}") == 1
        with contextlib.suppress(*TRANSIENT_ERRORS):  # the first try may still see the cut
            await link.db.fetchval("SELECT 1")
        after = await link.db.fetchval("SELECT pg_backend_pid()")
        assert after != before
    finally:
        await link.close()


async def test_watched_keys_unite_each_keys_device_relays(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each key's relays are the sorted union over its devices, read a few rows at a time on
    PostgreSQL (its cursor chunk made tiny here, so one key's rows span several chunks)."""
    monkeypatch.setattr("sigil_push.store.postgres.devices.KEY_CHUNK", 2)
    alice, bob, carol = (secrets.token_hex(32) for _ in range(3))
    for pubkey, relays in (
        (alice, ("wss://b", "wss://a")), (bob, ()), (alice, ()), (alice, ("wss://c", "wss://a")),
        (carol, ()), (bob, ()),
    ):
        await store.devices.register(
            pubkey, "ios", secrets.token_hex(32), "opaque", relays, None, 5
        )

    watched = await store.devices.watched_keys()

    assert watched == {alice: ("wss://a", "wss://b", "wss://c"), bob: (), carol: ()}
