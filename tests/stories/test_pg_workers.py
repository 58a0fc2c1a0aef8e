"""Several `sigil-push serve` workers on one PostgreSQL database form one instance: real
processes, a real PostgreSQL server and a real `nostr-relay`; pushes are the dry-run sender's
log lines, counted over every worker's log.

- The workers split the key shards between them, each key watched by exactly one worker.
- SIGKILL one in the middle of a burst of DMs: its shards move to the others (the time is
  printed), and every DM is pushed; the only repeats allowed are the killed worker's own
  in-doubt pushes (sent, not yet deleted from the outbox: the provider boundary).
- A rolling restart (SIGTERM and start, one worker after the other) loses and doubles nothing.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import nostr_sdk
import pytest

from sigil_push.shards import DEFAULT_SHARDS, shard_of
from testkit.bridge_harness import (
    eventually,
    eventually_async,
    new_token,
    register,
    wakeups,
)
from testkit.nostr_client import hex_of, kind4_dm, publish, user
from testkit.processes import FAST_RECONNECT, worker_health
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import on_database

pytestmark = pytest.mark.slow  # every story here starts its own processes

LEASE_SECONDS = 3
WORKER_TOML = FAST_RECONNECT + f"lease_seconds = {LEASE_SECONDS}\n[push]\nsend_timeout_seconds = 1\n"


def _shards(services: list[ServiceProcess]) -> list[list[int]]:
    return [list(worker_health(s).get("shards", [])) for s in services]


def _partitioned(services: list[ServiceProcess]) -> bool:
    """Every shard held by exactly one of `services`, each holding some."""
    held = _shards(services)
    every = [shard for shards in held for shard in shards]
    return all(held) and sorted(every) == list(range(DEFAULT_SHARDS))


def _watched(services: list[ServiceProcess], relay: str) -> int:
    """Keys subscribed on `relay`, summed over workers, counting only live subscriptions."""
    total = 0
    for service in services:
        state = worker_health(service).get("relays", {}).get(relay) or {}
        if not state.get("live"):
            return -1
        total += int(state.get("keys") or 0)
    return total


def _pushes(services: list[ServiceProcess]) -> Counter[str]:
    total: Counter[str] = Counter()
    for service in services:
        total.update(wakeups(service))
    return total


async def _diagnosis(
    postgres_url: str, services: list[ServiceProcess], relay: str, dms: list[dict[str, Any]]
) -> str:
    """What a failed hand-over left behind, for the failure message: each worker's shards and
    subscriptions (/health), the lease table, and per DM not pushed exactly once its
    recipient's shard and its owner, whether the DM is in `seen_events` (handled: swallowed
    as a baseline, or its outbox row lost) and its outbox row (claimed by whom, until when,
    attempts), and whether the recipient is baselined on the relay. Worker logs stay in
    each worker's folder (pytest keeps the last runs' tmp_path)."""
    pushes = _pushes(services)
    lines = ["diagnosis:"]
    for service in services:
        report = worker_health(service)
        lines.append(
            f"  {service.folder.name} ({report.get('worker', 'down')}):"
            f" {len(report.get('shards', []))} shards,"
            f" relay {report.get('relays', {}).get(relay)!r}, log {service.log_path}"
        )
    connection = await asyncpg.connect(postgres_url)
    try:
        leases = await connection.fetch(
            "SELECT owner, count(*) AS shards, min(expires_at - now()) AS soonest,"
            " max(epoch) AS epoch FROM shard_leases GROUP BY owner ORDER BY owner"
        )
        lines += [f"  leases: {dict(row)}" for row in leases]
        owners = dict(await connection.fetch("SELECT shard, owner FROM shard_leases"))
        for dm in dms:
            if pushes[dm["id"]] == 1:
                continue
            recipient = next(t[1] for t in dm["tags"] if t[0] == "p")
            seen = await connection.fetchval(
                "SELECT count(*) FROM seen_events WHERE event_id = decode($1, 'hex')", dm["id"]
            )
            outbox = await connection.fetch(
                "SELECT claimed_by, claimed_until_ms, attempts, next_attempt_ms FROM outbox"
                " WHERE event_id = $1", dm["id"]
            )
            baselined = await connection.fetchval(
                "SELECT count(*) FROM relay_baselines WHERE relay = $1 AND pubkey = $2",
                relay, recipient,
            )
            shard = shard_of(recipient)
            lines.append(
                f"  DM {dm['id'][:12]} pushed {pushes[dm['id']]}x: shard {shard} owner"
                f" {owners.get(shard)}, seen {seen}, baselined {baselined},"
                f" outbox {[dict(row) for row in outbox]}"
            )
    finally:
        await connection.close()
    return "\n".join(lines)


async def _instance(
    tmp_path: Path, postgres_url: str, relay: RelayProcess, workers: list[ServiceProcess],
    count: int,
) -> list[nostr_sdk.Keys]:
    """`count` workers sharing the database, `count * 4` users registered through the first,
    and every user's key watched by exactly one worker."""
    for index in range(count):
        service = ServiceProcess(tmp_path / f"worker{index}", [relay.url], WORKER_TOML)
        workers.append(on_database(service, postgres_url, key_file=tmp_path / "bridge.key").start())
    await eventually(lambda: _partitioned(workers), "the workers split the shards")
    recipients = [user() for _ in range(count * 4)]
    for recipient in recipients:
        register(workers[0], recipient, new_token())
    await eventually(
        lambda: _watched(workers, relay.url) == len(recipients),
        "each key watched by exactly one worker", timeout=60,
    )
    return recipients


async def test_sigkill_mid_burst_moves_shards_and_pushes_every_dm(
    tmp_path: Path, postgres_url: str, start_relay: Callable[..., RelayProcess],
    workers: list[ServiceProcess],
) -> None:
    relay = start_relay("relay")
    recipients = await _instance(tmp_path, postgres_url, relay, workers, 3)
    sender = user()
    dms = [kind4_dm(sender, recipients[i % len(recipients)], f"burst {i}") for i in range(60)]

    await publish(relay.url, *dms[:30])
    victim = workers[1]
    victim_shards = set(_shards([victim])[0])
    assert victim.stop(signal.SIGKILL) == -9
    killed_at = time.monotonic()
    await publish(relay.url, *dms[30:])
    survivors = [workers[0], workers[2]]
    await eventually(lambda: _partitioned(survivors), "the survivors took every shard", timeout=60)
    hand_over = time.monotonic() - killed_at
    print(f"shard hand-over after SIGKILL: {hand_over:.1f} s (lease {LEASE_SECONDS} s,"
          f" {len(victim_shards)} shards moved)")

    ids = [dm["id"] for dm in dms]
    try:
        await eventually(
            lambda: all(_pushes(workers)[i] >= 1 for i in ids), "every DM pushed", timeout=90
        )
    except AssertionError as failure:
        raise AssertionError(
            f"{failure}\n{await _diagnosis(postgres_url, workers, relay.url, dms)}"
        ) from None
    pushes = _pushes(workers)
    in_doubt = set(wakeups(victim))
    repeated = {i for i in ids if pushes[i] > 1}
    diagnosis = "" if repeated <= in_doubt and all(pushes[i] <= 2 for i in ids) else (
        await _diagnosis(postgres_url, workers, relay.url, dms)
    )
    assert repeated <= in_doubt, f"only the killed worker's in-doubt pushes may repeat{diagnosis}"
    assert all(pushes[i] <= 2 for i in ids), diagnosis
    print(f"{len(ids)} DMs, {len(repeated)} repeated (in doubt at the kill)")
    # the survivors' subscriptions of the moved keys may still await EOSE when the last push
    # is logged (a push needs the event, not its REQ's EOSE), and /health may be slow to
    # answer on a loaded machine: this converges, it is not an instant's state
    await eventually(
        lambda: _watched(survivors, relay.url) == len(recipients),
        "the survivors watch every key once", timeout=60,
    )


async def test_rolling_restart_loses_and_doubles_nothing(
    tmp_path: Path, postgres_url: str, start_relay: Callable[..., RelayProcess],
    workers: list[ServiceProcess],
) -> None:
    relay = start_relay("relay")
    recipients = await _instance(tmp_path, postgres_url, relay, workers, 2)
    sender = user()
    dms = [kind4_dm(sender, recipients[i % len(recipients)], f"roll {i}") for i in range(40)]
    batches = [dms[:10], dms[10:20], dms[20:30], dms[30:]]
    await publish(relay.url, *batches[0])
    for index, worker in enumerate(workers):
        assert worker.stop() == 0  # SIGTERM: shards given back, outbox flushed or kept
        await publish(relay.url, *batches[1 + index])
        worker.start()
        await eventually(lambda: _partitioned(workers), "shards split again", timeout=60)
    await publish(relay.url, *batches[3])
    ids = [dm["id"] for dm in dms]
    await eventually(
        lambda: all(_pushes(workers)[i] >= 1 for i in ids), "every DM pushed", timeout=90
    )
    pushes = _pushes(workers)
    assert {i: pushes[i] for i in ids} == dict.fromkeys(ids, 1), "nothing lost, nothing doubled"


async def test_a_dm_after_a_new_keys_first_eose_survives_a_kill_before_its_baseline_commits(
    tmp_path: Path, postgres_url: str, start_relay: Callable[..., RelayProcess],
    workers: list[ServiceProcess],
) -> None:
    """A key registered on a worker that subscribes it (fresh), reaches EOSE and receives a DM
    live, and is SIGKILLed before its committer's transaction (the baseline, then the DM's
    outbox row) commits. The worker taking the shard over finds no baseline stored for the
    key: the DM sent after the registration must still be pushed, not taken for one of the
    events that predate the registration. The committer is held back by a table lock the
    test holds on `relay_baselines`, released once the worker is dead."""
    relay = start_relay("relay")
    recipients = await _instance(tmp_path, postgres_url, relay, workers, 2)
    await eventually(
        lambda: sorted(map(len, _shards(workers))) == [128, 128], "the shards settled", 60
    )
    # a worker taking shards over re-requests their (baselined) keys and tries negentropy
    # first; nostr-relay never answers NEG-OPEN, so that worker is not live until the 4 s
    # fallback to paged REQ has caught the window up: count from live subscriptions only
    await eventually(
        lambda: _watched(workers, relay.url) == len(recipients),
        "every key live again after the hand-over", 60,
    )
    victim, survivor = workers
    held = set(_shards([victim])[0])
    newcomer = next(k for k in iter(user, None) if shard_of(hex_of(k)) in held)
    sender = user()
    history = kind4_dm(sender, newcomer, "before the registration", int(time.time()) - 600)
    await publish(relay.url, history)
    watched = len(recipients)
    blocker = await asyncpg.connect(postgres_url)
    try:
        blocking = blocker.transaction()
        await blocking.start()
        await blocker.execute("LOCK TABLE relay_baselines IN SHARE MODE")
        register(survivor, newcomer, new_token())
        await eventually(
            lambda: _watched(workers, relay.url) == watched + 1, "the new key subscribed", 60
        )

        async def baseline_waits() -> bool:
            return bool(await blocker.fetchval(
                "SELECT count(*) FROM pg_locks WHERE NOT granted"
                " AND relation = 'relay_baselines'::regclass"
            ))

        await eventually_async(baseline_waits, "the victim's baseline held back", 60)
        dm = kind4_dm(sender, newcomer, "sent after the registration")
        await publish(relay.url, dm)
        assert victim.stop(signal.SIGKILL) == -9
    finally:
        await blocker.close()
    await eventually(
        lambda: _watched([survivor], relay.url) == watched + 1, "the survivor took the key", 60
    )
    await eventually(lambda: wakeups(survivor)[dm["id"]] == 1, "the DM pushed", 60)
    assert _pushes(workers)[history["id"]] == 0, "what predates the registration stays unpushed"
