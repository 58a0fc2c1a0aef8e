"""Workers joining a running instance settle to a fair split, losing and doubling nothing.

Real `sigil-push serve` processes on a real PostgreSQL server and a real `nostr-relay`;
pushes are the dry-run sender's log lines, counted over every worker's log. One worker runs
alone with every shard; a second and then a third join while DMs keep arriving. The first
gives its excess back once confirmed, the newcomers take it and catch up from the relay's cursors,
and the instance ends at 86/85/85 shards with each key watched by exactly one worker. Every DM
is pushed exactly once (no worker dies, so nothing is in doubt), and once settled the split
stays put: no lease changes owner while every worker renews several times.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import asyncpg
import nostr_sdk
import pytest

from sigil_push.shards import DEFAULT_SHARDS
from testkit.bridge_harness import eventually, eventually_async, new_token, register, wakeups
from testkit.nostr_client import kind4_dm, publish, user
from testkit.processes import FAST_RECONNECT, worker_health
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import on_database

pytestmark = pytest.mark.slow  # every story here starts its own processes

LEASE_SECONDS = 2
WORKER_TOML = FAST_RECONNECT + f"lease_seconds = {LEASE_SECONDS}\n"


def _counts(services: list[ServiceProcess]) -> list[int]:
    return [len(worker_health(s).get("shards", [])) for s in services]


def _settled(services: list[ServiceProcess], relay: str, keys: int) -> bool:
    """Every shard held by exactly one worker, each at shards // N or one more, and every key
    subscribed by exactly one worker on a live connection."""
    health = [worker_health(s) for s in services]
    held = [list(h.get("shards", [])) for h in health]
    least = DEFAULT_SHARDS // len(services)
    if sorted(s for h in held for s in h) != list(range(DEFAULT_SHARDS)):
        return False
    if not all(least <= len(h) <= least + 1 for h in held):
        return False
    states = [h.get("relays", {}).get(relay) or {} for h in health]
    return all(s.get("live") for s in states) and sum(int(s.get("keys") or 0) for s in states) == keys


def _pushes(services: list[ServiceProcess]) -> Counter[str]:
    total: Counter[str] = Counter()
    for service in services:
        total.update(wakeups(service))
    return total


async def _leases(url: str) -> dict[int, tuple[str, int]]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch("SELECT shard, owner, epoch FROM shard_leases")
    finally:
        await connection.close()
    return {int(r["shard"]): (str(r["owner"]), int(r["epoch"])) for r in rows}


async def _renewed_since(url: str, since: float, times: int) -> bool:
    """Whether every live worker has renewed at least `times` heartbeat periods after the
    database time `since` (seconds since the epoch)."""
    connection = await asyncpg.connect(url)
    try:
        oldest = await connection.fetchval(
            "SELECT min(extract(epoch FROM heartbeat_at)) FROM workers"
        )
    finally:
        await connection.close()
    return float(oldest) >= since + times * LEASE_SECONDS / 3


async def test_workers_joining_settle_fairly_and_push_every_dm_once(
    tmp_path: Path, postgres_url: str, start_relay: Callable[..., RelayProcess],
    workers: list[ServiceProcess],
) -> None:
    relay = start_relay("relay")

    def add_worker() -> ServiceProcess:
        service = ServiceProcess(tmp_path / f"worker{len(workers)}", [relay.url], WORKER_TOML)
        key_file = tmp_path / "bridge.key"
        public = workers[0].url if workers else None
        workers.append(on_database(service, postgres_url, public, key_file).start())
        return service

    first = add_worker()
    recipients: list[nostr_sdk.Keys] = [user() for _ in range(12)]
    for recipient in recipients:
        register(first, recipient, new_token())
    await eventually(lambda: _settled(workers, relay.url, len(recipients)), "one worker live")
    assert _counts(workers) == [DEFAULT_SHARDS]

    sender = user()
    dms = [kind4_dm(sender, recipients[i % len(recipients)], f"join {i}") for i in range(48)]
    await publish(relay.url, *dms[:12])
    second = add_worker()
    # a DM burst while the shards are on their way to the newcomer
    await eventually(lambda: _counts([second])[0] > 0, "the second worker took shards")
    print("shards when the second burst went out:", _counts(workers))
    await publish(relay.url, *dms[12:24])
    third = add_worker()
    await eventually(lambda: _counts([third])[0] > 0, "the third worker took shards")
    print("shards when the third burst went out:", _counts(workers))
    await publish(relay.url, *dms[24:36])
    await eventually(
        lambda: _settled(workers, relay.url, len(recipients)), "a fair split", timeout=90
    )
    counts = _counts(workers)
    assert sorted(counts) == [85, 85, 86], counts
    await publish(relay.url, *dms[36:])

    ids = [dm["id"] for dm in dms]
    await eventually(
        lambda: all(_pushes(workers)[i] >= 1 for i in ids), "every DM pushed", timeout=90
    )
    pushes = _pushes(workers)
    assert {i: pushes[i] for i in ids} == dict.fromkeys(ids, 1), "nothing lost, nothing doubled"

    settled = await _leases(postgres_url)
    connection = await asyncpg.connect(postgres_url)
    try:
        now = float(await connection.fetchval("SELECT extract(epoch FROM now())"))
    finally:
        await connection.close()
    await eventually_async(
        lambda: _renewed_since(postgres_url, now, 3), "every worker renewed three times"
    )
    assert await _leases(postgres_url) == settled, "a settled split moved"
