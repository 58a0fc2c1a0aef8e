"""The store's record of what each relay delivered (migration 0010, `catchup_items`), on both
engines: what negentropy offers a relay as "already have", per shard's keys or for a whole
firehose relay, bounded by the catch-up window."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from sigil_push.bridge.catchup_ledger import MAX_PENDING_ROWS, CatchupLedger
from sigil_push.config import parse_config
from sigil_push.store.bridge_rows import merged_catchup_rows
from sigil_push.store.factory import PostgresStore, SqliteStore, connect_bridge
from sigil_push.store.interface import UNADDRESSED, BridgeConnection
from testkit.stores import sql_of

RELAY, OTHER = "wss://a.example", "wss://b.example"
ALICE, BOB, CAROL = "a" * 64, "b" * 64, "c" * 64


def _id(n: int) -> str:
    return f"{n:064x}"


@asynccontextmanager
async def bridge_link(database: str, folder: Path) -> AsyncIterator[BridgeConnection]:
    """The bridge committer's own connection, where the catch-up items are written."""
    link = await connect_bridge(parse_config({"server": {"database": database}},
                                             folder / "relays.toml"))
    try:
        yield link
    finally:
        await link.close()


async def test_items_are_per_relay_per_key_and_bounded_by_the_window(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    async with bridge_link(database, tmp_path) as link:
        await _items_story(link)


async def _items_story(link: BridgeConnection) -> None:
    items = link.catchup
    async with link.transaction():
        await items.add([
            (RELAY, ALICE, _id(1), 1_000),
            (RELAY, BOB, _id(1), 1_000),  # one DM to two recipients
            (RELAY, BOB, _id(2), 2_000),
            (RELAY, CAROL, _id(3), 3_000),
            (RELAY, UNADDRESSED, _id(4), 4_000),
            (OTHER, ALICE, _id(5), 5_000),
        ])
    async with link.transaction():
        await items.add([(RELAY, ALICE, _id(1), 1_000)])  # a repeat is kept once

    assert await items.items(RELAY, [ALICE, BOB], 0) == {_id(1): 1_000, _id(2): 2_000}
    assert await items.items(RELAY, [ALICE, BOB], 1_500) == {_id(2): 2_000}
    assert await items.items(RELAY, None, 0) == {
        _id(1): 1_000, _id(2): 2_000, _id(3): 3_000, _id(4): 4_000
    }, "a firehose relay's whole window, DMs for nobody here included"
    assert await items.items(OTHER, [ALICE], 0) == {_id(5): 5_000}

    async with link.transaction():
        assert await items.prune(2_500) == 3
    assert await items.items(RELAY, None, 0) == {_id(3): 3_000, _id(4): 4_000}
    async with link.transaction():
        assert await items.prune(2_500) == 0


async def test_a_shard_of_many_keys_is_read_in_chunks(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """1,200 keys (more than one query's worth on SQLite) all find their rows."""
    keys = [f"{n:064x}" for n in range(10_000, 11_200)]
    async with bridge_link(database, tmp_path) as link:
        async with link.transaction():
            await link.catchup.add([(RELAY, key, _id(n), 100 + n) for n, key in enumerate(keys)])
        found = await link.catchup.items(RELAY, keys, 0)
    assert len(found) == len(keys)


async def test_rows_carry_the_recipient_for_a_relay_or_some_keys(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """`rows` is what the ledger loads into memory: (recipient, id, created_at), for the
    whole relay or for the keys asked, within the window."""
    async with bridge_link(database, tmp_path) as link:
        async with link.transaction():
            await link.catchup.add([
                (RELAY, ALICE, _id(1), 1_000), (RELAY, BOB, _id(1), 1_000),
                (RELAY, CAROL, _id(2), 2_000), (OTHER, ALICE, _id(3), 3_000),
            ])
        assert sorted(await link.catchup.rows(RELAY, None, 0)) == [
            (ALICE, _id(1), 1_000), (BOB, _id(1), 1_000), (CAROL, _id(2), 2_000)
        ]
        assert await link.catchup.rows(RELAY, [CAROL], 0) == [(CAROL, _id(2), 2_000)]
        assert await link.catchup.rows(RELAY, None, 1_500) == [(CAROL, _id(2), 2_000)]


async def test_the_ledger_reads_each_relay_once_then_answers_from_memory(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """The first reconciliation of a relay loads its rows from the store; DMs noted after go
    into memory as they are delivered, so the next reconciliation reads nothing from the
    store (a row another writer adds is not seen, the noted one is); a key asked for the
    first time (a shard moved here) is read once; pruning with the window empties memory,
    and the sigil_push_memory_entries gauge follows."""
    now = int(time.time())
    async with bridge_link(database, tmp_path) as link:
        async with link.transaction():
            await link.catchup.add([
                (RELAY, ALICE, _id(1), now - 100), (RELAY, UNADDRESSED, _id(2), now - 90),
                (RELAY, CAROL, _id(3), now - 80),
            ])
        ledger = CatchupLedger(3600, link, asyncio.Lock())

        assert await ledger.items(RELAY, None, 0) == {
            _id(1): now - 100, _id(2): now - 90, _id(3): now - 80
        }
        assert ledger.store_reads == 1
        assert _gauge("catchup_items") == 3

        ledger.note(RELAY, _id(4), now - 10, (BOB,))
        async with link.transaction():
            await link.catchup.add([(RELAY, ALICE, _id(5), now - 5)])
        assert await ledger.items(RELAY, None, 0) == {
            _id(1): now - 100, _id(2): now - 90, _id(3): now - 80, _id(4): now - 10
        }
        assert await ledger.items(RELAY, [ALICE, BOB], now - 50) == {_id(4): now - 10}
        assert ledger.store_reads == 1, "answered from memory"

        assert await ledger.items(OTHER, [ALICE], 0) == {}
        async with link.transaction():
            await link.catchup.add([(OTHER, ALICE, _id(6), now - 3), (OTHER, BOB, _id(7), now - 1)])
        assert await ledger.items(OTHER, [ALICE], 0) == {}
        assert await ledger.items(OTHER, [ALICE, BOB], 0) == {_id(7): now - 1}
        assert ledger.store_reads == 3, "ALICE once, then BOB once"

        await ledger.flush()
        async with link.transaction():
            await link.catchup.add([(RELAY, ALICE, _id(8), now - 7200)])
        assert await ledger.prune(-3600) >= 0  # cutoff: now, everything older goes
        assert await ledger.items(RELAY, None, 0) == {}
        assert ledger.kept_items() == 0
        assert _gauge("catchup_items") == 0


def _gauge(structure: str) -> float | None:
    return REGISTRY.get_sample_value("sigil_push_memory_entries", {"structure": structure})


async def test_the_copies_of_one_dm_are_one_row_listing_their_relays(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """With every DM from several relays, the ledger's rows (one per relay and recipient)
    reach the store as one row per (recipient, DM) listing its relays (migration 0016): each
    relay still reads back exactly what it delivered, and the window prunes one row per
    recipient and DM, whatever its relays."""
    now = int(time.time())
    async with bridge_link(database, tmp_path) as link:
        ledger = CatchupLedger(3600, link, asyncio.Lock())
        recipients = (CAROL, ALICE, BOB)
        for n in range(12):
            for relay in (RELAY, OTHER):
                if relay == RELAY or n % 2:
                    ledger.note(relay, _id(n), now - n, (recipients[n % 3],))
        ledger.confirm(_id(n) for n in range(12))  # as the committer does once decided
        await ledger.flush()

        assert await link.catchup.items(RELAY, [ALICE, BOB, CAROL], 0) == {
            _id(n): now - n for n in range(12)
        }
        assert await link.catchup.items(OTHER, [ALICE, BOB, CAROL], 0) == {
            _id(n): now - n for n in range(12) if n % 2
        }
        assert await link.catchup.items(OTHER, None, 0) == {
            _id(n): now - n for n in range(12) if n % 2
        }
        async with link.transaction():
            assert await link.catchup.prune(now + 1) == 12, "one row per DM, not per copy"


async def test_a_later_relays_delivery_is_added_to_the_dms_row_once(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path
) -> None:
    """A relay's copy written by a later flush joins the DM's row: that relay reads it back,
    and a restart's read past a snapshot's cut (`noted_since`) finds it; the same delivery
    written again (or a relay already listed) changes nothing; the other recipient's row and
    an unaddressed DM are their own."""
    third = "wss://c.example"
    async with bridge_link(database, tmp_path) as link:
        catchup = link.catchup
        async with link.transaction():
            await catchup.add([
                (RELAY, ALICE, _id(1), 1_000), (OTHER, ALICE, _id(1), 1_000),
                (RELAY, BOB, _id(1), 1_000), (RELAY, UNADDRESSED, _id(2), 2_000),
            ])
        cut = int(time.time() * 1000) + 1
        await _after(cut)
        async with link.transaction():
            await catchup.add([(third, ALICE, _id(1), 1_000), (third, UNADDRESSED, _id(2), 2_000)])
        async with link.transaction():
            await catchup.add([(third, ALICE, _id(1), 1_000), (OTHER, ALICE, _id(1), 1_000)])

        assert sorted(await catchup.rows(third, None, 0)) == [
            (UNADDRESSED, _id(2), 2_000), (ALICE, _id(1), 1_000)
        ]
        assert sorted(await catchup.noted_since(third, cut, 0)) == [
            (UNADDRESSED, _id(2), 2_000), (ALICE, _id(1), 1_000)
        ]
        assert await catchup.noted_since(third, cut + 60_000, 0) == []
        assert await catchup.rows(OTHER, None, 0) == [(ALICE, _id(1), 1_000)]
        assert sorted(await catchup.rows(RELAY, None, 0)) == [
            (UNADDRESSED, _id(2), 2_000), (ALICE, _id(1), 1_000), (BOB, _id(1), 1_000)
        ]
        assert await catchup.rows(RELAY, [BOB], 0) == [(BOB, _id(1), 1_000)]
        assert await catchup.rows(third, [BOB], 0) == []
        assert sorted(
            tuple(row) for row in await sql_of(store).execute_fetchall(
                "SELECT relays FROM catchup_items"
            )
        ) == [(RELAY,), (f"{RELAY} {OTHER} {third}",), (f"{RELAY} {third}",)]
        async with link.transaction():
            assert await catchup.prune(5_000) == 3


async def _after(ms: int) -> None:
    """Wait until the clock has passed `ms` (unix milliseconds)."""
    while time.time() * 1000 <= ms:
        await asyncio.sleep(0.005)


def test_merged_rows_are_one_per_recipient_and_dm_in_key_order_each_id_packed_once() -> None:
    """Both engines bind `merged_catchup_rows`: a DM's deliveries by several relays to one
    recipient are one row listing those relays in the order noted (a relay noted twice
    listed once), keyed and unaddressed rows alike, ordered by the two ids joined (the lock
    order), the ids as bytes, each key converted once for the flush."""
    rows = [
        (RELAY, ALICE, _id(2), 2_000), (RELAY, ALICE, _id(1), 1_000),
        (OTHER, ALICE, _id(1), 1_000), (RELAY, BOB, _id(1), 1_000),
        (OTHER, ALICE, _id(1), 1_000), (OTHER, UNADDRESSED, _id(3), 3_000),
        (RELAY, UNADDRESSED, _id(3), 3_000),
    ]
    merged = merged_catchup_rows(rows, 77)
    key = bytes.fromhex
    assert merged == [
        (f"{OTHER} {RELAY}", b"", key(_id(3)), 3_000, 77),
        (f"{RELAY} {OTHER}", key(ALICE), key(_id(1)), 1_000, 77),
        (RELAY, key(ALICE), key(_id(2)), 2_000, 77),
        (RELAY, key(BOB), key(_id(1)), 1_000, 77),
    ]
    assert merged[1][1] is merged[2][1]
    assert merged_catchup_rows([], 77) == []


async def test_a_failed_early_flush_is_logged_by_its_type(
    store: SqliteStore | PostgresStore, database: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ledger holding MAX_PENDING_ROWS rows writes them at once, in a task of its own; when
    that write fails (here a time beyond 64 bits, which no engine stores) the failure is
    logged by its type, never left to asyncio's "Task exception was never retrieved", whose
    traceback quotes the exception's message (asyncpg quotes a refused argument, its DETAIL
    the rows: relay URLs, keys)."""
    ids = [_id(n) for n in range(MAX_PENDING_ROWS)]
    async with bridge_link(database, tmp_path) as link:
        ledger = CatchupLedger(10**30, link, asyncio.Lock())
        with caplog.at_level(logging.WARNING):
            for event_id in ids:
                ledger.note(RELAY, event_id, 2**70, (ALICE,))
            ledger.confirm(ids)
            for _ in range(300):
                if "catch-up items not saved" in caplog.text:
                    break
                await asyncio.sleep(0.02)
            del ledger  # and with it the flush's task:
            gc.collect()  # where asyncio reports an exception nobody retrieved
    assert "catch-up items not saved" in caplog.text
    assert "never retrieved" not in caplog.text and "Traceback" not in caplog.text
