"""The store's record of what each relay delivered (migration 0010, `catchup_items`), on both
engines: what negentropy offers a relay as "already have", per shard's keys or for a whole
firehose relay, bounded by the catch-up window."""

from __future__ import annotations

from sigil_push.store.catchup_items import UNADDRESSED, CatchupItems
from sigil_push.store.factory import PostgresStore, SqliteStore

RELAY, OTHER = "wss://a.example", "wss://b.example"
ALICE, BOB, CAROL = "a" * 64, "b" * 64, "c" * 64


def _id(n: int) -> str:
    return f"{n:064x}"


async def test_items_are_per_relay_per_key_and_bounded_by_the_window(
    store: SqliteStore | PostgresStore,
) -> None:
    items = CatchupItems(store.db)
    await items.add([
        (RELAY, ALICE, _id(1), 1_000),
        (RELAY, BOB, _id(1), 1_000),  # one DM to two recipients
        (RELAY, BOB, _id(2), 2_000),
        (RELAY, CAROL, _id(3), 3_000),
        (RELAY, UNADDRESSED, _id(4), 4_000),
        (OTHER, ALICE, _id(5), 5_000),
    ])
    await items.add([(RELAY, ALICE, _id(1), 1_000)])  # a repeat is kept once

    assert await items.items(RELAY, [ALICE, BOB], 0) == {_id(1): 1_000, _id(2): 2_000}
    assert await items.items(RELAY, [ALICE, BOB], 1_500) == {_id(2): 2_000}
    assert await items.items(RELAY, None, 0) == {
        _id(1): 1_000, _id(2): 2_000, _id(3): 3_000, _id(4): 4_000
    }, "a firehose relay's whole window, DMs for nobody here included"
    assert await items.items(OTHER, [ALICE], 0) == {_id(5): 5_000}

    assert await items.prune(2_500) == 3
    assert await items.items(RELAY, None, 0) == {_id(3): 3_000, _id(4): 4_000}
    assert await items.prune(2_500) == 0


async def test_a_shard_of_many_keys_is_read_in_chunks(store: SqliteStore | PostgresStore) -> None:
    """1,200 keys (more than one query's worth) all find their rows."""
    items = CatchupItems(store.db)
    keys = [f"{n:064x}" for n in range(10_000, 11_200)]
    await items.add([(RELAY, key, _id(n), 100 + n) for n, key in enumerate(keys)])
    found = await items.items(RELAY, keys, 0)
    assert len(found) == len(keys)
