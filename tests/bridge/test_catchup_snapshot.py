"""A firehose relay's catch-up items as a stored NIP-77 snapshot (migrations 0013 and 0021,
`catchup_snapshot_parts` and `catchup_items.noted_at`), on both engines: the store keeps its
parts per relay and scope and prunes them with the window; the ledger writes them from memory
(appending new parts, rewriting the whole only now and then) and, in the next process, serves
the window as that snapshot plus only the rows written since its newest cut; a snapshot that is
corrupt, too large or cut before the window is refused, counted, and the window's rows are read
instead."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from sigil_push.bridge import catchup_ledger
from sigil_push.bridge.catchup_ledger import FIREHOSE_SCOPE, CatchupLedger
from sigil_push.nostr.nip77 import SortedItems
from sigil_push.nostr.nip77_snapshot import (
    LayeredItems,
    SnapshotItems,
    SnapshotPart,
    encode_snapshot,
)
from sigil_push.store.factory import PostgresStore, SqliteStore
from sigil_push.store.interface import UNADDRESSED, BridgeConnection
from testkit.stores import sql_of
from tests.store.test_catchup_items import ALICE, BOB, OTHER, RELAY, _id, bridge_link


def _loads(outcome: str) -> float:
    return REGISTRY.get_sample_value(
        "sigil_push_catchup_snapshot_loads_total", {"outcome": outcome}
    ) or 0.0


async def _stored(link: BridgeConnection, relay: str) -> dict[str, int]:
    """Every item the relay's stored snapshot parts hold (event id → created_at)."""
    found: dict[str, int] = {}
    for _, _, data in await link.catchup.snapshot(relay, FIREHOSE_SCOPE):
        part = SnapshotPart(data)
        found.update((raw.hex(), at)
                     for at, raw in SnapshotItems.of_records(bytes(part.records), 0).pairs(0))
    return found


async def _age_rows(store: SqliteStore | PostgresStore, seconds: int) -> None:
    """Date every catch-up row's write back (so a cut now lies after all of them)."""
    await sql_of(store).execute(
        "UPDATE catchup_items SET noted_at = noted_at - ?", (seconds * 1000,)
    )


async def test_the_store_keeps_snapshot_parts_per_relay_and_scope_and_prunes_them(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """Parts are added (a part number again replaces it) or replace all the parts before;
    they are read in part order, and a part goes with the prune once its newest item left
    the window."""
    now = int(time.time())
    ms = now * 1000
    async with bridge_link(database, tmp_path) as link:
        catchup = link.catchup
        assert await catchup.snapshot(RELAY, FIREHOSE_SCOPE) == []
        async with link.transaction():
            await catchup.save_snapshot(RELAY, FIREHOSE_SCOPE, ms - 10_000, [(0, now - 10, b"zero")])
            await catchup.save_snapshot(
                RELAY, FIREHOSE_SCOPE, ms - 5_000, [(2, now - 5, b"two"), (1, now - 4000, b"one")]
            )
            await catchup.save_snapshot(OTHER, FIREHOSE_SCOPE, ms - 9_000, [(0, now - 1, b"x")])
            await catchup.save_snapshot(OTHER, FIREHOSE_SCOPE, ms - 8_000, [(0, now - 2, b"y")])
        assert await catchup.snapshot(RELAY, FIREHOSE_SCOPE) == [
            (0, ms - 10_000, b"zero"), (1, ms - 5_000, b"one"), (2, ms - 5_000, b"two")
        ]
        assert await catchup.snapshot(OTHER, FIREHOSE_SCOPE) == [(0, ms - 8_000, b"y")]
        assert await catchup.snapshot(RELAY, "shard") == []

        async with link.transaction():
            await catchup.add([(RELAY, ALICE, _id(1), now - 100), (RELAY, BOB, _id(2), now - 50)])
        await _age_rows(store, 20)
        async with link.transaction():
            await catchup.add([(RELAY, ALICE, _id(3), now - 3000), (OTHER, BOB, _id(4), now)])
        assert await catchup.noted_since(RELAY, ms - 1000, 0) == [(ALICE, _id(3), now - 3000)]
        assert await catchup.noted_since(RELAY, ms - 1000, now - 2000) == []
        assert len(await catchup.noted_since(RELAY, ms - 30_000, 0)) == 3

        async with link.transaction():
            await catchup.prune(now - 3600)
        assert [part for part, _, _ in await catchup.snapshot(RELAY, FIREHOSE_SCOPE)] == [0, 2]
        async with link.transaction():
            await catchup.save_snapshot(
                RELAY, FIREHOSE_SCOPE, ms, [(3, now, b"three")], drop=[0]
            )
        assert [part for part, _, _ in await catchup.snapshot(RELAY, FIREHOSE_SCOPE)] == [2, 3]
        async with link.transaction():
            await catchup.save_snapshot(
                RELAY, FIREHOSE_SCOPE, ms, [(0, now, b"all")], replace=True
            )
        assert await catchup.snapshot(RELAY, FIREHOSE_SCOPE) == [(0, ms, b"all")]


async def _noted_window(link: BridgeConnection, now: int, count: int) -> dict[str, int]:
    rows = [(RELAY, ALICE if n % 2 else UNADDRESSED, _id(n), now - 1000 + n) for n in range(count)]
    async with link.transaction():
        await link.catchup.add(rows)
    return {event_id: created_at for _, _, event_id, created_at in rows}


async def _snapshotted(link: BridgeConnection, now: int) -> tuple[dict[str, int], CatchupLedger]:
    """A window of 40 noted items, and a ledger that loaded the relay and saved them as its
    snapshot's first part."""
    window = await _noted_window(link, now, 40)
    ledger = CatchupLedger(3600, link, asyncio.Lock())
    await ledger.held(RELAY, None, 0)
    await ledger.save_snapshots()
    return window, ledger


def _note_unaddressed(ledger: CatchupLedger, items: dict[str, int]) -> None:
    for event_id, at in items.items():
        ledger.note_unaddressed_event(RELAY, {"id": event_id, "created_at": at})


async def test_a_restart_reads_the_snapshot_and_only_the_rows_written_since(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """The first process reads the window's rows (no snapshot yet), notes more, and writes a
    snapshot at its clean shutdown. The next reads that snapshot as bytes plus the rows
    written since its cut (one, here), and the window it serves is the same; a window moved
    past the oldest leaves them out. A keyed read then reads the rows again."""
    now = int(time.time())
    async with bridge_link(database, tmp_path) as link:
        window = await _noted_window(link, now, 300)
        await _age_rows(store, 20)
        first = CatchupLedger(3600, link, asyncio.Lock())
        none_before = _loads("none")
        base, items = await first.held(RELAY, None, 0)
        assert base is None and items == window
        assert _loads("none") == none_before + 1
        first.note(RELAY, _id(500), now - 1, (BOB,))
        first.confirm([_id(500)])
        window[_id(500)] = now - 1
        await first.flush()
        await first.save_snapshots(final=True)
        stored = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)
        assert len(stored) == 1 and now * 1000 <= stored[0][1] <= time.time() * 1000
        assert len(await _stored(link, RELAY)) == 301

        await _age_rows(store, 20)
        async with link.transaction():
            await link.catchup.add([(RELAY, ALICE, _id(600), now - 2000)])  # back-dated
        window[_id(600)] = now - 2000

        second = CatchupLedger(3600, link, asyncio.Lock())
        loaded_before = _loads("loaded")
        base, items = await second.held(RELAY, None, 0)
        assert _loads("loaded") == loaded_before + 1
        assert base is not None and len(base) == 301
        assert items == {_id(600): now - 2000}, "only the row written since the cut"
        assert second.kept_items() == 302
        assert await second.items(RELAY, None, 0) == window
        since = now - 1000 + 100
        assert await second.items(RELAY, None, since) == {
            event_id: at for event_id, at in window.items() if at >= since
        }

        keyed_before = _loads("keyed")
        assert await second.items(RELAY, [BOB], 0) == {_id(500): now - 1}
        assert _loads("keyed") == keyed_before + 1


async def test_unaddressed_items_are_kept_in_memory_and_the_snapshot_never_as_rows(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A firehose event naming nobody here (`note_unaddressed`, read off the raw frame, or
    `note_unaddressed_event`) spares the relay's next reconciliation and goes into its next
    snapshot, but is no `catchup_items` row: on a firehose nearly every event is one, and
    its row was most of the cost of reading the relay. One noted before the relay's first
    load is kept through it; a relay never reconciled is loaded by the housekeeping once it
    holds enough for a snapshot; a clean stop of a process that never loaded the relay (no
    snapshot can hold it) writes what it kept as rows."""
    now = int(time.time())
    frame = (f'["EVENT","live",{{"id":"{_id(7)}","pubkey":"{ALICE}","created_at":{now - 5},'
             f'"kind":7,"tags":[["p","{BOB}"]],"content":"+","sig":"{"0" * 128}"}}]')
    async with bridge_link(database, tmp_path) as link:
        async with link.transaction():
            await link.catchup.add([(RELAY, ALICE, _id(1), now - 9)])
        ledger = CatchupLedger(3600, link, asyncio.Lock())
        ledger.note_unaddressed(RELAY, frame)
        assert await ledger.held(RELAY, None, 0) == (None, {_id(1): now - 9, _id(7): now - 5})
        ledger.note_unaddressed_event(RELAY, {"id": _id(8), "created_at": now - 4})
        window = {_id(1): now - 9, _id(7): now - 5, _id(8): now - 4}
        assert await ledger.items(RELAY, None, 0) == window
        await ledger.flush()
        assert await link.catchup.rows(RELAY, None, 0) == [(ALICE, _id(1), now - 9)]
        await ledger.save_snapshots(final=True)
        assert await _stored(link, RELAY) == window
        assert await link.catchup.rows(RELAY, None, 0) == [(ALICE, _id(1), now - 9)]

        unloaded = CatchupLedger(3600, link, asyncio.Lock())
        unloaded.note_unaddressed_event(OTHER, {"id": _id(9), "created_at": now - 3})
        await unloaded.flush()
        assert await link.catchup.rows(OTHER, None, 0) == []
        await unloaded.save_snapshots(final=True)
        assert await link.catchup.rows(OTHER, None, 0) == [(UNADDRESSED, _id(9), now - 3)]
        assert await link.catchup.snapshot(OTHER, FIREHOSE_SCOPE) == []

        # never reconciled, but holding enough for a snapshot: loaded by the housekeeping's
        # pass, then cut like any relay's
        monkeypatch.setattr(catchup_ledger, "RECUT_MIN_ITEMS", 2)
        third = "wss://c.example"
        busy = CatchupLedger(3600, link, asyncio.Lock())
        busy.note_unaddressed_event(third, {"id": _id(10), "created_at": now - 2})
        await busy.save_snapshots()
        assert await link.catchup.snapshot(third, FIREHOSE_SCOPE) == [], "one is not enough"
        busy.note_unaddressed_event(third, {"id": _id(11), "created_at": now - 1})
        await busy.save_snapshots()
        assert set(await _stored(link, third)) == {_id(10), _id(11)}
        assert await link.catchup.rows(third, None, 0) == []


async def test_a_new_snapshot_is_cut_once_the_rows_since_the_last_are_many(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Periodic cuts: none while the items noted since the last snapshot are few, one once
    they pass the threshold; it holds the old snapshot's items and the new ones, and items
    noted while it is cut are kept for the next."""
    monkeypatch.setattr(catchup_ledger, "RECUT_MIN_ITEMS", 10)
    now = int(time.time())
    async with bridge_link(database, tmp_path) as link:
        window, ledger = await _snapshotted(link, now)
        first = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)
        assert len(first) == 1 and len(await _stored(link, RELAY)) == 40
        for n in range(5):
            ledger.note(RELAY, _id(100 + n), now - 500 - n, (ALICE,))
        ledger.confirm(_id(100 + n) for n in range(12))
        await ledger.save_snapshots()
        assert await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE) == first, "5 are few"
        for n in range(5, 12):
            ledger.note(RELAY, _id(100 + n), now - 500 - n, (ALICE,))
        ledger.confirm(_id(100 + n) for n in range(5, 12))
        await ledger.save_snapshots()
        second = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)
        assert len(second) == 2 and second[0] == first[0], "a part added, the first kept"
        assert len(await _stored(link, RELAY)) == 52
        window.update({_id(100 + n): now - 500 - n for n in range(12)})
        base, items = await ledger.held(RELAY, None, 0)
        assert base is not None and len(base) == 52 and items == {}
        assert await ledger.items(RELAY, None, 0) == window


@pytest.mark.parametrize("damage", ["corrupt", "oversized", "stale"])
async def test_a_snapshot_that_cannot_serve_falls_back_to_reading_the_window(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path, damage: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = int(time.time())
    async with bridge_link(database, tmp_path) as link:
        window = await _noted_window(link, now, 50)
        pairs = sorted((at, bytes.fromhex(event_id)) for event_id, at in window.items())
        data = encode_snapshot(pairs)
        cut = now * 1000
        if damage == "corrupt":
            data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
        elif damage == "oversized":
            monkeypatch.setattr(catchup_ledger, "MAX_SNAPSHOT_ITEMS", 10)
        else:
            cut = (now - 7200) * 1000
        async with link.transaction():
            await link.catchup.save_snapshot(RELAY, FIREHOSE_SCOPE, cut, [(0, now, data)])
        ledger = CatchupLedger(3600, link, asyncio.Lock())
        before = _loads(damage)
        base, items = await ledger.held(RELAY, None, 0)
        assert base is None and items == window, "every row read instead"
        assert _loads(damage) == before + 1


async def test_rows_of_a_dm_not_yet_committed_are_not_written_nor_snapshotted(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DM noted on delivery but not yet decided by the committer is offered as had in this
    process, but neither its row nor a snapshot says so on disk: if the process died before
    the commit, the next one's reconciliation must fetch it again. Confirmed, it is written;
    never confirmed (dropped before the committer), it is let go after UNCONFIRMED_SECONDS."""
    now = int(time.time())
    async with bridge_link(database, tmp_path) as link:
        window = await _noted_window(link, now, 30)
        ledger = CatchupLedger(3600, link, asyncio.Lock())
        await ledger.held(RELAY, None, 0)
        ledger.note(RELAY, _id(900), now - 5, (ALICE,))
        ledger.note(RELAY, _id(901), now - 6, (BOB,))
        assert (await ledger.held(RELAY, None, 0))[1] == {
            **window, _id(900): now - 5, _id(901): now - 6
        }, "in memory at once"
        await ledger.flush()
        await ledger.save_snapshots(final=True)
        assert _id(900) not in await link.catchup.items(RELAY, None, 0)
        assert set(await _stored(link, RELAY)) == set(window)
        base, items = await ledger.held(RELAY, None, 0)
        assert base is not None and items == {_id(900): now - 5, _id(901): now - 6}

        ledger.confirm([_id(900)])
        monkeypatch.setattr(catchup_ledger, "UNCONFIRMED_SECONDS", 0.0)
        await ledger.flush()
        on_disk = await link.catchup.items(RELAY, None, 0)
        assert on_disk[_id(900)] == now - 5 and _id(901) not in on_disk
        ledger.confirm([_id(901)])  # too late: let go
        await ledger.flush()
        assert _id(901) not in await link.catchup.items(RELAY, None, 0)


async def test_new_items_are_appended_as_parts_and_late_ones_kept_apart_until_a_rewrite(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Items newer than the snapshot's run are a new part of it (the parts before are not
    written again, its sums follow theirs); items among its last part's are merged with it
    into a new part replacing it; items that sort before that, or are dated
    ahead of now, are a late part; a restart reads the run and the late parts as the same
    window, its fingerprints those of one sorted set; once the late items pass a quarter of
    the run, everything is rewritten as one part (and what is dated ahead, a late one)."""
    monkeypatch.setattr(catchup_ledger, "RECUT_MIN_ITEMS", 2)
    now = int(time.time())
    async with bridge_link(database, tmp_path) as link:
        window, ledger = await _snapshotted(link, now)
        [first] = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)

        newer = {_id(200 + n): now - 100 + n for n in range(10)}
        _note_unaddressed(ledger, newer)
        await ledger.save_snapshots()
        parts = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)
        assert [part for part, _, _ in parts] == [0, 1] and parts[0] == first
        appended = SnapshotPart(parts[1][2])
        assert not appended.late and appended.count == 10
        assert appended.start_sum == SnapshotPart(first[2]).end_sum()

        # a little out of order: merged with the last part (no more than twice their number)
        jittered = {_id(250 + n): now - 96 + n for n in range(6)}
        _note_unaddressed(ledger, jittered)
        await ledger.save_snapshots()
        parts = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)
        assert [part for part, _, _ in parts] == [0, 2] and parts[0] == first
        assert not SnapshotPart(parts[1][2]).late and SnapshotPart(parts[1][2]).count == 16

        late = {_id(300): now - 2000, _id(301): now - 1500, _id(302): now + 600}
        _note_unaddressed(ledger, late)
        await ledger.save_snapshots()
        parts = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)
        assert [part for part, _, _ in parts] == [0, 2, 3]
        assert SnapshotPart(parts[2][2]).late and SnapshotPart(parts[2][2]).count == 3
        window.update(newer)
        window.update(jittered)
        window.update(late)
        assert await _stored(link, RELAY) == window
        assert await ledger.items(RELAY, None, 0) == window

        restarted = CatchupLedger(3600, link, asyncio.Lock())
        base, items = await restarted.held(RELAY, None, 0)
        assert base is not None and len(base) == 56 and items == late
        run = SortedItems()
        run.add({event_id: at for event_id, at in window.items() if event_id not in late})
        assert LayeredItems(base, SortedItems()).fingerprint(0, 56) == run.fingerprint(0, 56)
        assert LayeredItems(base, SortedItems()).fingerprint(7, 51) == run.fingerprint(7, 51)

        more_late = {_id(400 + n): now - 1900 + n for n in range(12)}
        _note_unaddressed(restarted, more_late)
        await restarted.save_snapshots()
        window.update(more_late)
        parts = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)
        assert [part for part, _, _ in parts] == [0, 1], "rewritten: the run, what is ahead"
        assert SnapshotPart(parts[1][2]).late and SnapshotPart(parts[1][2]).count == 1
        assert await _stored(link, RELAY) == window
        assert await restarted.items(RELAY, None, 0) == window
        base, items = await CatchupLedger(3600, link, asyncio.Lock()).held(RELAY, None, 0)
        assert base is not None and len(base) == len(window) - 1
        assert items == {_id(302): now + 600}


async def test_a_few_items_among_a_large_last_part_are_late_and_the_part_is_not_written_again(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a live firehose each save's new items mostly follow the run, a few sort among its
    last part's (events of the same second, or a little late). Merging those few would write
    that whole part again, and the part grows with every save: instead they are a late part
    (an item the run already holds, noted again, is not one of them), the new part follows the
    run unchanged, and a restart serves the same window."""
    monkeypatch.setattr(catchup_ledger, "RECUT_MIN_ITEMS", 2)
    now = int(time.time())
    async with bridge_link(database, tmp_path) as link:
        window, ledger = await _snapshotted(link, now)
        newer = {_id(200 + n): now - 100 + n for n in range(30)}
        _note_unaddressed(ledger, newer)
        await ledger.save_snapshots()
        before = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)
        assert [part for part, _, _ in before] == [0, 1]

        among = {_id(260): now - 95, _id(261): now - 80}
        following = {_id(270 + n): now - 60 + n for n in range(5)}
        again = {_id(210): newer[_id(210)]}
        _note_unaddressed(ledger, among | following | again)
        await ledger.save_snapshots()
        parts = await link.catchup.snapshot(RELAY, FIREHOSE_SCOPE)
        assert [part for part, _, _ in parts] == [0, 1, 2, 3]
        assert parts[:2] == before, "the run's parts are not written again"
        appended, late = SnapshotPart(parts[2][2]), SnapshotPart(parts[3][2])
        assert not appended.late and appended.count == len(following)
        assert appended.start_sum == SnapshotPart(parts[1][2]).end_sum()
        assert late.late and late.count == len(among)
        window.update(newer)
        window.update(among)
        window.update(following)
        assert await _stored(link, RELAY) == window
        assert sum(SnapshotPart(data).count for _, _, data in parts) == len(window)
        assert await ledger.items(RELAY, None, 0) == window

        restarted = CatchupLedger(3600, link, asyncio.Lock())
        base, items = await restarted.held(RELAY, None, 0)
        assert base is not None and items == among
        run = SortedItems()
        run.add({event_id: at for event_id, at in window.items() if event_id not in among})
        assert len(base) == len(window) - len(among)
        assert LayeredItems(base, SortedItems()).fingerprint(0, len(base)) == run.fingerprint(
            0, len(base)
        )
