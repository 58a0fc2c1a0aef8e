"""What a registered key costs a worker's memory, the bound on keys per worker (a million keys
must fit in 600 MB): one string per key shared by every structure that holds it, and no
per-key containers for the common key that names no relay of its own.

Both tests start a real in-process bridge on a real SQLite file; its relays are closed
loopback ports, so what is measured is loading and planning the keys.
"""

from __future__ import annotations

import secrets
import time
import tracemalloc
from pathlib import Path

import pytest

from sigil_push.store.sqlite.database import open_database
from testkit.in_process import in_process_bridge
from testkit.rules import dm_checks, reason_of

RELAYS = ["ws://127.0.0.1:9", "ws://127.0.0.1:11"]  # nothing listens on either


async def _store_keys(folder: Path, keys: list[str], relays: str = "[]") -> None:
    db = await open_database(folder / "push.db")
    try:
        now = int(time.time())
        await db.executemany(
            "INSERT INTO devices (pubkey, platform, token, relays, registered_at, updated_at)"
            " VALUES (?, 'android', ?, ?, ?, ?)",
            [(key, f"token-{key}", relays, now, now) for key in keys],
        )
        await db.commit()
    finally:
        await db.close()


async def test_a_restart_holds_one_string_per_key_across_relays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stored baselines of two relays, read back a few rows per query: none is lost, and each
    is the registry's own string of its key, not a copy per row."""
    monkeypatch.setattr("sigil_push.bridge.relay_state.BASELINE_PAGE", 3)
    keys = [secrets.token_hex(32) for _ in range(7)]
    orphan = secrets.token_hex(32)  # a baseline whose key has no device (kept, as before)
    await _store_keys(tmp_path, keys)
    db = await open_database(tmp_path / "push.db")
    try:
        await db.executemany(
            "INSERT INTO relay_baselines (relay, pubkey, baselined_at) VALUES (?, ?, 1)",
            [(relay, key) for relay in RELAYS for key in [*keys, orphan]],
        )
        await db.commit()
    finally:
        await db.close()

    async with in_process_bridge(tmp_path, "push.db", [{"url": url} for url in RELAYS]) as parts:
        bridge = parts.bridge
        canonical = {key: key for key in bridge._registry.keys}
        assert canonical.keys() == set(keys)
        for relay in RELAYS:
            baselines = bridge.pool.baselines_of(relay)
            assert baselines == {*keys, orphan}
            assert all(canonical[key] is key for key in baselines if key != orphan)


async def test_a_key_without_relays_of_its_own_costs_the_bridge_little(tmp_path: Path) -> None:
    """20,000 keys that name no relay, on a firehose relay: what the bridge and relay modules
    allocate for them, per key. A frozenset per key in the registry and in the relay plan made
    it over 500 bytes (384 with the plan's alone gone); now it is a slot in the registry's set
    and one in the relay's subscription, about 130."""
    keys = [secrets.token_hex(32) for _ in range(20_000)]
    await _store_keys(tmp_path, keys)
    ours = [tracemalloc.Filter(True, "*/sigil_push/bridge/*"),
            tracemalloc.Filter(True, "*/sigil_push/relays/*")]
    tracemalloc.start()
    try:
        async with in_process_bridge(tmp_path, "push.db", [{"url": RELAYS[0], "mode": "firehose"}]) as parts:
            assert len(parts.bridge._pool.subs[RELAYS[0]].keys) == len(keys)
            held = tracemalloc.take_snapshot().filter_traces(ours)
    finally:
        tracemalloc.stop()
    per_key = sum(stat.size for stat in held.statistics("filename")) / len(keys)
    print(f"bridge and relay structures: {per_key:.0f} bytes per key")
    assert per_key < 200


async def test_a_follows_only_user_with_2000_follows_costs_the_bridge_little_memory(
    tmp_path: Path,
) -> None:
    """Issue 20: lists stay in the store. 200 follows-only users, each with a stored kind 3 of
    2,000 follows: their devices in the committer's cache and a DM's author checked against
    every list leave at most 20 KB per user resident (the Python side holds a `Rules` tuple per
    device, not the follows). One engine: this is the bridge process's memory."""
    from sigil_push.store.records import LIST_FLAGS, pack_keys

    users = [secrets.token_hex(32) for _ in range(200)]
    await _store_keys(tmp_path, users)
    db = await open_database(tmp_path / "push.db")
    try:
        follows = pack_keys(secrets.token_hex(32) for _ in range(2000))
        await db.executemany("UPDATE devices SET senders = 'follows' WHERE pubkey = ?",
                             [(user,) for user in users])
        await db.executemany(
            "INSERT INTO user_lists (pubkey, kind, created_at, event_id, entries, entry_count)"
            " VALUES (?, 3, 1, ?, ?, 2000)",
            [(user, secrets.token_hex(32), follows) for user in users],
        )
        await db.executemany(  # as the store does when it stores a list
            f"UPDATE devices SET list_flags = {LIST_FLAGS.format(pubkey='?1')} WHERE pubkey = ?1",
            [(user,) for user in users],
        )
        await db.commit()
    finally:
        await db.close()
    async with in_process_bridge(tmp_path, "push.db", [{"url": url} for url in RELAYS]) as parts:
        committer = parts.bridge._committer
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            cached = await committer._devices_of(users)
            checks = dm_checks([(secrets.token_hex(32), cached[user]) for user in users])
            answers = await committer._link.lists.blocked(  # type: ignore[union-attr]
                checks, reason_of
            )
            assert all(answer for answer in answers), "strangers are not followed"
            del checks, answers
            # aiosqlite's thread keeps its last result until its next statement: one read's
            # lists (OWNERS_PER_READ of them), a bounded buffer, not a cost per user
            await parts.db.execute_fetchall("SELECT 1")
            await committer._link.state.cursors()  # type: ignore[union-attr]
            current, peak = tracemalloc.get_traced_memory()
            per_user = (current - before) / len(users)
        finally:
            tracemalloc.stop()
        assert all(d.rules is not None and d.rules.follows_known for d in cached[users[0]])
        assert per_user <= 20_000, per_user
        # the lists are read a group at a time: all 200 at once (12.8 MB, twice over while
        # copied) would be the peak otherwise
        assert peak - before < 10_000_000, peak - before
