"""Restarts that catch a firehose relay up from a stored NIP-77 snapshot (issue 24), on both
store engines, against rust-nostr's relay: each DM of each outage is pushed exactly once,
none from before, and only the missing events are fetched, whether the window's items come
from the rows (the first restart), from the snapshot the last process left plus the rows
written since, from a snapshot saved by a process stopped in the middle of its catch-up, or
from the rows again because the snapshot is corrupt."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from sigil_push.bridge.catchup_ledger import FIREHOSE_SCOPE
from testkit.deadlines import scaled
from testkit.fakes.harness import eventually as poll
from testkit.in_process import InProcessBridge, in_process_bridge
from testkit.nostr_client import hex_of, kind4_dm, user
from testkit.rust_relay import RustRelay
from testkit.stores import Engine, opened, sql_of
from tests.relays.test_catchup import (
    BRIDGE,
    NegentropyProxy,
    direct_messages,
    metric,
    queued_per_event,
    until_caught_up,
)

USERS = 6


def _loads(outcome: str) -> float:
    return metric("sigil_push_catchup_snapshot_loads_total", outcome=outcome)


async def test_restarts_from_a_snapshot_push_each_new_dm_once(
    tmp_path: Path, engine: Engine
) -> None:
    recipients, senders = [user() for _ in range(USERS)], [user() for _ in range(2)]
    database = engine.database("push.db")
    async with RustRelay() as rust, NegentropyProxy(rust.url, refuse=False) as proxy:
        url = proxy.url
        relays = [{"url": url, "mode": "firehose"}]
        proxy.release.set()
        await rust.publish(*direct_messages(senders, recipients, 400, int(time.time())))
        async with in_process_bridge(tmp_path, database, relays, BRIDGE) as parts:
            for n, recipient in enumerate(recipients):
                await parts.devices.register(
                    hex_of(recipient), "android", f"fcm-{n}", "opaque", (), None, 0
                )
            await poll(lambda: len(parts.bridge._registry.keys) == USERS, what="keys watched")
            await until_caught_up(parts, url, USERS)
        pushed: dict[str, int] = {}

        async def outage(count: int) -> set[str]:
            """New DMs while the bridge is down (dated now: after every registration, which
            a firehose catch-up requires of a DM it pushes)."""
            now = int(time.time())
            fresh = [kind4_dm(senders[n % 2], recipients[n % USERS], f"new {n}", now)
                     for n in range(count)]
            await rust.publish(*fresh)
            return {event["id"] for event in fresh}

        async def caught_up(parts: InProcessBridge, fresh: set[str]) -> None:
            async def all_queued() -> bool:
                return set(await queued_per_event(parts)) >= fresh

            await poll(all_queued, timeout=60, what="every new DM queued")
            await until_caught_up(parts, url, USERS)
            pushed.update(dict.fromkeys(fresh, 1))
            assert await queued_per_event(parts) == pushed, "each new DM once, nothing again"

        def fetched() -> float:
            return metric("sigil_push_catchup_events_fetched_total", relay=url,
                          method="negentropy")

        # the first restart: the window's rows are read, or the snapshot the first process
        # saved if it reconciled already; one is saved at stop
        fresh = await outage(8)
        reads_before, fetched_before = _loads("none") + _loads("loaded"), fetched()
        async with in_process_bridge(tmp_path, database, relays, BRIDGE) as parts:
            await caught_up(parts, fresh)
            assert _loads("none") + _loads("loaded") == reads_before + 1
            assert fetched() - fetched_before == 8, "only the missing events, by id"

        # the next: the snapshot and the rows written since
        fresh = await outage(9)
        loaded_before, fetched_before = _loads("loaded"), fetched()
        async with in_process_bridge(tmp_path, database, relays, BRIDGE) as parts:
            await caught_up(parts, fresh)
            assert _loads("loaded") == loaded_before + 1
            assert fetched() - fetched_before == 9, "only the missing events, by id"

        # stopped while its reconciliation is held at the relay: the snapshot it saves holds
        # nothing of this outage, so the next restart still finds all of it
        fresh = await outage(7)
        proxy.neg_opens, proxy.release = 0, asyncio.Event()
        proxy.reconciling.clear()
        async with in_process_bridge(tmp_path, database, relays, BRIDGE):
            await asyncio.wait_for(proxy.reconciling.wait(), scaled(30))
        proxy.release.set()
        loaded_before = _loads("loaded")
        async with in_process_bridge(tmp_path, database, relays, BRIDGE) as parts:
            await caught_up(parts, fresh)
            assert _loads("loaded") == loaded_before + 1

        # a corrupt snapshot: refused, counted, the rows read instead
        async with opened(database if engine.postgres else str(tmp_path / database)) as store:
            changed = await sql_of(store).execute(
                "UPDATE catchup_snapshot_parts SET data = ? WHERE relay = ? AND scope = ?",
                (b"NEG2" + bytes(60), url, FIREHOSE_SCOPE),
            )
            assert changed >= 1
        fresh = await outage(5)
        corrupt_before = _loads("corrupt")
        async with in_process_bridge(tmp_path, database, relays, BRIDGE) as parts:
            await caught_up(parts, fresh)
            assert _loads("corrupt") == corrupt_before + 1
