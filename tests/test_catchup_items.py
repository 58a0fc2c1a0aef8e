"""The store's record of what each relay delivered (migration 0010, `catchup_items`), on both
engines: what negentropy offers a relay as "already have", per shard's keys or for a whole
firehose relay, bounded by the catch-up window."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sigil_push.config import parse_config
from sigil_push.store.factory import PostgresStore, SqliteStore, connect_bridge
from sigil_push.store.interface import UNADDRESSED, BridgeConnection

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
