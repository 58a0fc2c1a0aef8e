"""Relay lists on a real PostgreSQL server: a save that fails (here its connection is cut while
it waits on a row another transaction holds) keeps the lists it did not store for the next
save, except those of keys forgotten meanwhile. Other workers, and this one after a restart,
find users' inbox relays in these rows."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.kinds import DM_RELAYS
from sigil_push.relays.discovery import RelayLists
from sigil_push.store.errors import StoreUnavailable
from sigil_push.store.postgres.bridge_state import PostgresRelayState
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.migrate import migrate
from testkit.deadlines import scaled


def _list_of(key: SecretKey, relay: str) -> Event:
    return sign_event(key, DM_RELAYS, "", [("relay", relay)], 1_700_000_000)


async def test_lists_a_failed_save_did_not_store_are_saved_next_time(postgres_url: str) -> None:
    """Keys x and y took new lists; the save waits on x's row (another transaction holds it),
    y is forgotten meanwhile (unregistered), and the save's connection is cut. The next save
    stores x's list and not y's: before, the failed save's lists were dropped, and the rows
    kept the old relays until the user published a new list."""
    await migrate(postgres_url)
    x, y = SecretKey.generate(), SecretKey.generate()
    db = PostgresDatabase(
        await asyncpg.connect(postgres_url), reconnect=lambda: asyncpg.connect(postgres_url)
    )
    lists = RelayLists(PostgresRelayState(db), allow_insecure=False)
    for key in (x, y):
        lists.offer(_list_of(key, "wss://inbox.example"))
    holder, watcher = await asyncpg.connect(postgres_url), await asyncpg.connect(postgres_url)
    try:
        await holder.execute("BEGIN")
        await holder.execute(
            "INSERT INTO relay_lists (pubkey, kind, created_at, relays) VALUES ($1, $2, 1, '[]')",
            x.public_key_hex, DM_RELAYS)
        saving = asyncio.create_task(lists.save())
        deadline = asyncio.get_running_loop().time() + scaled(60)
        while not await watcher.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'"
        ):
            assert not saving.done(), saving
            assert asyncio.get_running_loop().time() < deadline, "the save never waited"
            await asyncio.sleep(0.01)
        lists.forget([y.public_key_hex])
        await watcher.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname ="
            " current_database() AND wait_event_type = 'Lock'")
        with pytest.raises(StoreUnavailable):  # the cut connection, as the store types it
            await saving
        await holder.execute("ROLLBACK")

        await lists.save()
        rows = await watcher.fetch("SELECT pubkey, relays FROM relay_lists")
        assert [(r["pubkey"], r["relays"]) for r in rows] == [
            (x.public_key_hex, '["wss://inbox.example"]')
        ]
    finally:
        for connection in (holder, watcher):
            await connection.close()
        await db.close()
