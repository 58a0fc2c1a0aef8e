"""The database goes away and comes back, and nothing is lost (issue 34, item 9): real
`sigil-push serve` processes, a real `nostr-relay`, and a steady stream of DMs published before,
during and after the outage; pushes are the dry-run sender's log lines of every worker.

- PostgreSQL, two workers: the server is stopped (`pg_ctl stop -m fast`) for longer than a
  lease and a heartbeat, so both workers let go of their key shards, and started again on the
  same port. Meanwhile `/health` is 503 and names the store (never 200), `POST /register`
  answers `503 unavailable` within 10 s; afterwards the workers take their shards back
  without a restart, and every DM is pushed exactly once. Before the fix a worker whose
  reshard failed during the outage believed it still watched its shards, and never watched
  them again: 614 of 1,200 DMs lost in bench/db_outage.py.
- SQLite: another connection holds an exclusive lock on the file; the API answers 503 within
  10 s (it used to wait 10 s and more) and every DM is pushed exactly once.
- SQLite locked while no event arrives: `/health` turns 503 within seconds all the same (the
  deferred wakeups' claim, a write each second, meets the lock).
- A worker that has held no shard for longer than a lease (here: every free shard locked by
  another transaction, the database otherwise fine) says so in `/health`, with a 503.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nostr_sdk
import pytest

from sigil_push.shards import DEFAULT_SHARDS
from sigil_push.store.postgres.migrate import migrate
from testkit.bridge_harness import _call, eventually, new_token, register
from testkit.deadlines import CONDITION_SECONDS, REQUEST_SECONDS, scaled
from testkit.nostr_client import npub_of, publish_steadily, user
from testkit.postgres import PostgresServer
from testkit.processes import FAST_RECONNECT, worker_health
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import on_database

pytestmark = pytest.mark.slow  # every story here starts its own processes

LEASE_SECONDS = 3
WORKER_TOML = FAST_RECONNECT + f"lease_seconds = {LEASE_SECONDS}\n"
RATE = 5.0
"""DMs a second: a steady stream, so some are published in each phase of the outage."""
API_ANSWER_SECONDS = 10.0
"""What the API must answer within (the requirement under test: not scaled)."""


def _status(service: ServiceProcess) -> int:
    """The public /health status (0 while it does not answer)."""
    try:
        return httpx.get(service.url + "/health", timeout=scaled(REQUEST_SECONDS)).status_code
    except httpx.HTTPError:
        return 0


def _reasons(service: ServiceProcess) -> dict[str, str]:
    return dict(worker_health(service).get("reasons") or {})


def _partitioned(services: list[ServiceProcess]) -> bool:
    """Every shard held by exactly one of `services`, each holding some."""
    held = [list(worker_health(s).get("shards", [])) for s in services]
    every = sorted(shard for shards in held for shard in shards)
    return all(held) and every == list(range(DEFAULT_SHARDS))


PUSHED = re.compile(r"dry-run wakeup platform=\S+ token=…(\S+) events=(\d+)")
"""The dry-run sender's line: the token's suffix and how many events the wakeup carried (it
names no event ids, so DMs are counted per recipient: each has one device of its own)."""


def _pushes(services: list[ServiceProcess]) -> Counter[str]:
    """Events pushed so far per device token suffix, over every worker."""
    total: Counter[str] = Counter()
    for service in services:
        for suffix, events in PUSHED.findall(service.log()):
            total[suffix] += int(events)
    return total


def _expected(tokens: list[str], sent: list[str]) -> Counter[str]:
    """What each device must have been pushed: `publish_steadily` sends to recipients in turn."""
    return Counter(tokens[index % len(tokens)][-6:] for index in range(len(sent)))


def _register_fresh(service: ServiceProcess) -> tuple[httpx.Response, float]:
    """A new user's registration; its answer and how long it took."""
    keys = user()
    body = {"npub": npub_of(keys), "platform": "android", "device_token": new_token()}
    started = time.monotonic()
    response = _call(service, keys, "POST", "/register", body)
    return response, time.monotonic() - started


def _assert_unavailable(service: ServiceProcess) -> None:
    response, took = _register_fresh(service)
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "unavailable"
    assert took < API_ANSWER_SECONDS, f"the API took {took:.1f} s to answer"


async def _while(condition: Callable[[], bool], sent: list[str], more: int) -> None:
    """Until `more` further DMs went out (the stream goes on meanwhile)."""
    target = len(sent) + more
    await eventually(lambda: len(sent) >= target and condition(), f"{more} more DMs sent", 60)


async def _every_dm_pushed_once(
    services: list[ServiceProcess], tokens: list[str], sent: list[str]
) -> None:
    """Each recipient's device was pushed each DM sent to it: as many events as DMs, no fewer
    (lost) and, once they are all there, no more (doubled)."""
    expected = _expected(tokens, sent)
    await eventually(
        lambda: all(_pushes(services)[t] >= n for t, n in expected.items()), "every DM pushed",
        timeout=120,
    )
    pushes = _pushes(services)
    assert {t: pushes[t] for t in expected} == dict(expected), "DMs pushed more than once"


class HealthWatch:
    """Polls the public /health of services in the background and keeps what it saw."""

    def __init__(self, services: list[ServiceProcess]) -> None:
        self._services = services
        self.seen: list[int] = []
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        while True:
            for service in self._services:
                self.seen.append(await asyncio.to_thread(_status, service))
            await asyncio.sleep(0.2)

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> list[int]:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.seen


async def test_postgres_stopped_for_longer_than_a_lease_loses_no_dm_and_shards_come_back(
    tmp_path: Path, own_postgres_server: PostgresServer,
    start_relay: Callable[..., RelayProcess], workers: list[ServiceProcess],
) -> None:
    server = own_postgres_server
    url = server.create_database()
    relay = start_relay("relay")
    for index in range(2):
        service = ServiceProcess(tmp_path / f"worker{index}", [relay.url], WORKER_TOML)
        workers.append(on_database(service, url, key_file=tmp_path / "bridge.key").start())
    await eventually(lambda: _partitioned(workers), "the workers split the shards", 60)
    recipients: list[nostr_sdk.Keys] = [user() for _ in range(8)]
    tokens = [new_token() for _ in recipients]
    for recipient, token in zip(recipients, tokens, strict=True):
        register(workers[0], recipient, token)
    await eventually(
        lambda: sum(int((worker_health(w).get("relays", {}).get(relay.url) or {}).get("keys")
                        or 0) for w in workers) == len(recipients),
        "each key watched by one worker", 60,
    )
    sent: list[str] = []
    stop = asyncio.Event()
    stream = asyncio.create_task(publish_steadily(relay.url, recipients, RATE, stop, sent))
    await _while(lambda: True, sent, 10)

    server.halt("fast")
    logs_at_halt = [len(w.log()) for w in workers]
    sent_at_halt = len(sent)
    await eventually(
        lambda: all("the store (PostgreSQL) is unreachable" in _reasons(w).get("shard-leases", "")
                    for w in workers),
        "both workers' /health names the store", 30,
    )
    health = HealthWatch(workers)
    health.start()
    for worker in workers:
        _assert_unavailable(worker)
    # longer than a lease: each worker's leases lapse and it lets go of its shards, and a lease
    # later still holds none, which its /health says
    await eventually(
        lambda: all("holding 0 of 256 key shards" in w.log()[start:]
                    for w, start in zip(workers, logs_at_halt, strict=True)),
        "both workers let go of their shards", 60,
    )
    await eventually(
        lambda: all(_reasons(w).get("key-shards", "").startswith("holding no key shards")
                    for w in workers),
        "both workers say they hold no shard", 60,
    )
    seen_during = await health.stop()
    assert seen_during and 200 not in seen_during, f"/health during the outage: {seen_during}"
    server.resume()
    sent_at_resume = len(sent)
    assert sent_at_resume > sent_at_halt, "DMs were published during the outage"

    await eventually(lambda: _partitioned(workers), "the workers took their shards back", 60)
    await eventually(lambda: all(_status(w) == 200 for w in workers), "/health 200 again", 60)
    await _while(lambda: True, sent, 10)
    stop.set()
    await stream
    await _every_dm_pushed_once(workers, tokens, sent)


async def test_sqlite_locked_by_another_connection_answers_503_in_time_and_loses_no_dm(
    tmp_path: Path, start_relay: Callable[..., RelayProcess],
) -> None:
    relay = start_relay("relay")
    with ServiceProcess(tmp_path / "service", [relay.url], FAST_RECONNECT) as service:
        recipients = [user() for _ in range(4)]
        tokens = [new_token() for _ in recipients]
        for recipient, token in zip(recipients, tokens, strict=True):
            register(service, recipient, token)
        await eventually(
            lambda: (worker_health(service).get("relays", {}).get(relay.url) or {}).get("keys")
            == len(recipients), "every key watched", 60,
        )
        sent: list[str] = []
        stop = asyncio.Event()
        stream = asyncio.create_task(publish_steadily(relay.url, recipients, RATE, stop, sent))
        await _while(lambda: True, sent, 10)
        lock = sqlite3.connect(
            service.database, isolation_level=None, timeout=scaled(CONDITION_SECONDS)
        )
        try:
            lock.execute("BEGIN EXCLUSIVE")
            for _ in range(2):
                _assert_unavailable(service)
            await eventually(
                lambda: "bridge-commit" in _reasons(service), "/health says commits fail", 60
            )
            assert _status(service) == 503
            await _while(lambda: True, sent, 10)
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        await eventually(lambda: _status(service) == 200, "/health 200 again", 60)
        await _while(lambda: True, sent, 10)
        stop.set()
        await stream
        await _every_dm_pushed_once([service], tokens, sent)


async def test_sqlite_locked_while_no_event_arrives_turns_health_503_within_seconds(
    tmp_path: Path, start_relay: Callable[..., RelayProcess],
) -> None:
    """With nothing to commit, the committer used to learn of a locked file only from the
    next event's batch: `/health` said 200 for as long as no event arrived. The deferred
    wakeups' claim, a write each second, now tells it too: 503 naming `bridge-commit` within
    the busy timeout and a claim, and 200 again once the lock goes."""
    relay = start_relay("relay")
    with ServiceProcess(tmp_path / "service", [relay.url], FAST_RECONNECT) as service:
        register(service, user(), new_token())
        await eventually(lambda: _status(service) == 200, "/health 200", 60)
        lock = sqlite3.connect(
            service.database, isolation_level=None, timeout=scaled(CONDITION_SECONDS)
        )
        try:
            lock.execute("BEGIN EXCLUSIVE")
            started = time.monotonic()
            await eventually(
                lambda: "bridge-commit" in _reasons(service), "/health names the store", 60
            )
            took = time.monotonic() - started
            assert _status(service) == 503
            assert took < scaled(API_ANSWER_SECONDS), f"/health took {took:.1f} s to say so"
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        await eventually(lambda: _status(service) == 200, "/health 200 again", 60)


async def test_a_worker_holding_no_shard_for_longer_than_a_lease_says_so(
    tmp_path: Path, postgres_url: str, workers: list[ServiceProcess],
) -> None:
    """The database answers, but every shard row is locked by another transaction, so the
    worker's heartbeats succeed and its takes (SKIP LOCKED) get nothing: its keys are
    watched by nobody. A lease later its /health is 503 and says it holds no key shards; once
    the lock goes it takes every shard and answers 200."""
    await migrate(postgres_url)
    blocker = await asyncpg.connect(postgres_url)
    try:
        await blocker.execute(
            "INSERT INTO shard_leases (shard) SELECT generate_series(0, $1 - 1)"
            " ON CONFLICT DO NOTHING", DEFAULT_SHARDS,
        )
        locking = blocker.transaction()
        await locking.start()
        await blocker.execute("SELECT shard FROM shard_leases FOR UPDATE")
        service = ServiceProcess(tmp_path / "worker", [], WORKER_TOML)
        workers.append(on_database(service, postgres_url).start(wait=False))
        await eventually(
            lambda: _reasons(service).get("key-shards", "").startswith("holding no key shards"),
            "/health says the worker holds no shard", 60,
        )
        assert _status(service) == 503
        report: dict[str, Any] = worker_health(service)
        assert report["shards"] == [], json.dumps(report)
        await locking.rollback()
    finally:
        await blocker.close()
    await eventually(
        lambda: len(worker_health(service).get("shards", [])) == DEFAULT_SHARDS,
        "the worker took every shard once they were free", 60,
    )
    await eventually(lambda: _status(service) == 200, "/health 200", 60)
