"""Shard leases on a real PostgreSQL server: three workers join, leave and die.

A monitor samples every worker's local view throughout: no shard is ever believed held by two
workers at once, and no (shard, epoch) ever has two owners. Waits poll with generous deadlines.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable

import asyncpg
import pytest
from prometheus_client import REGISTRY

from sigil_push.shards import (
    DEFAULT_SHARDS,
    Lease,
    ShardSet,
    StaleLease,
    fair_share,
    shard_of,
)
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.devices import PostgresDevices
from sigil_push.store.postgres.leases import SHARDS_CHANNEL, ShardLeaser, check_lease, rebalance
from sigil_push.store.postgres.migrate import migrate
from sigil_push.store.postgres.sharding import ShardWatch
from testkit.deadlines import scaled
from testkit.postgres import PostgresServer

LEASE_SECONDS = 2.0

pytestmark = pytest.mark.slow  # the stories wait on real lease timers (LEASE_SECONDS)


class Monitor:
    """Samples the leasers' local views and records every (shard, epoch) -> owner it sees."""

    def __init__(self, leasers: list[ShardLeaser]) -> None:
        self.leasers = leasers
        self.owners: dict[tuple[int, int], str] = {}
        self.violations: list[str] = []
        self._task = asyncio.create_task(self._run())

    def sample(self) -> None:
        seen: dict[int, str] = {}
        for leaser in self.leasers:
            for shard, epoch in leaser.held().items():
                if shard in seen:
                    self.violations.append(
                        f"shard {shard} held by {seen[shard]} and {leaser.worker_id}"
                    )
                seen[shard] = leaser.worker_id
                owner = self.owners.setdefault((shard, epoch), leaser.worker_id)
                if owner != leaser.worker_id:
                    self.violations.append(
                        f"shard {shard} epoch {epoch}: {owner} and {leaser.worker_id}"
                    )

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        assert not self.violations, self.violations[:5]


async def until(condition: Callable[[], bool], timeout: float = 60.0) -> float:
    """Poll until `condition` holds; returns how long it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > scaled(timeout):
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def covered(leasers: list[ShardLeaser], each_at_most: int) -> bool:
    views = [leaser.held() for leaser in leasers]
    shards = set().union(*views)
    return shards == set(range(DEFAULT_SHARDS)) and all(len(view) <= each_at_most for view in views)


async def _no_keys(_shards: ShardSet) -> None:
    """The bridge's side of a shard change, in tests of the leases alone: nothing to load."""


def heartbeating(leaser: ShardLeaser) -> ShardWatch:
    """`leaser` driven as `serve` drives it: a ShardWatch (supervised heartbeats) over a
    bridge with no keys."""
    return ShardWatch(leaser, _no_keys)


@pytest.fixture
async def pool(postgres_url: str) -> AsyncIterator[asyncpg.Pool]:
    await migrate(postgres_url)
    async with asyncpg.create_pool(postgres_url, min_size=1, max_size=8) as created:
        yield created


def test_shard_of_is_stable_and_spreads() -> None:
    assert shard_of("00" * 32) == 0
    assert shard_of("ff" * 32) == 255
    assert shard_of("0000000a" + "00" * 28) == 10
    assert fair_share(256, 3) == 86 and fair_share(256, 0) == 256
    with pytest.raises(ValueError):
        shard_of("abc")


def test_hex_pairs_select_exactly_the_keys_of_the_shards() -> None:
    """`ShardSet.hex_pairs` (the query filter of a restart's baseline read) accepts a key
    exactly when the shard set does, for shard counts dividing 256; None for the others."""
    keys = [secrets.token_hex(32) for _ in range(2_000)]
    for count, held in ((256, frozenset(range(0, 256, 3))), (8, frozenset({1, 6}))):
        shards = ShardSet(held, count, held)
        pairs = set(shards.hex_pairs() or ())
        assert [key[6:8] in pairs for key in keys] == [shards(key) for key in keys]
    assert ShardSet(frozenset({0}), 3, frozenset()).hex_pairs() is None


def test_rebalance_aims_at_a_fair_split_with_a_dead_band() -> None:
    """256 shards: 2 workers rest at 128/128, 3 at 86/85/85 (85 and 86 both fair); a worker
    gives down to 85 only while another has fewer than 85, takes an extra shard only while
    nobody does, and never takes more than is free."""
    assert rebalance(256, [0], 256) == (128, 0)
    assert rebalance(0, [256], 256) == (0, 0)  # nothing free yet
    assert rebalance(0, [224], 256) == (0, 32)
    assert rebalance(128, [128], 256) == (0, 0)
    assert rebalance(86, [85, 85], 256) == (0, 0)
    assert rebalance(85, [86, 85], 256) == (0, 0)
    assert rebalance(85, [85, 85], 256) == (0, 1)  # one shard is free: it may take it
    assert rebalance(86, [86, 84], 256) == (1, 0)  # the third is short: one goes back
    assert rebalance(84, [86, 85], 256) == (0, 1)
    assert rebalance(128, [128, 0], 256) == (42, 0)
    assert rebalance(0, [96, 96], 256) == (0, 64)
    assert rebalance(3, [], 256) == (0, 253)  # alone: everything


async def test_a_join_settles_in_one_give_back_at_start_up_then_in_steps(
    pool: asyncpg.Pool,
) -> None:
    """Heartbeats driven one by one. At start-up (nothing watched yet) the worker that holds
    everything gives the newcomer its half in one go, one beat after it first sees it
    (confirmation); once its keys are watched (`limit_steps`), a later join is settled in steps
    of shards / 8, so the keys left unwatched until the taker loads them stay few. Neither
    count ever moves back. A first heartbeat and a give-back are `moved` (announced to the
    others), a plain renewal is not; the beat that finds a worker over its share asks for an
    early next one (`confirming`). Once fair, heartbeats move no shard (epochs unchanged):
    86/85/85 on three workers."""
    lease = 60.0  # heartbeats are driven by hand: nothing expires during the test
    first, second, third = (ShardLeaser(pool, name, lease) for name in ("a", "b", "c"))
    assert len(await first.tick()) == DEFAULT_SHARDS
    assert first.moved and not first.confirming
    assert await second.tick() == {}
    assert second.moved

    async def beat(leasers: list[ShardLeaser]) -> list[int]:
        return [len(await leaser.tick()) for leaser in leasers]

    async def settle(leasers: list[ShardLeaser]) -> list[list[int]]:
        counts = [await beat(leasers)]
        while sorted(counts[-1]) != sorted(fair(len(leasers))):
            assert len(counts) < 20, counts
            counts.append(await beat(leasers))
        return counts

    def fair(workers: int) -> list[int]:
        least, extra = divmod(DEFAULT_SHARDS, workers)
        return [least + 1] * extra + [least] * (workers - extra)

    assert await beat([first, second]) == [DEFAULT_SHARDS, 0], "the first beat that sees it"
    assert first.confirming and not first.moved and not second.moved
    assert await beat([first, second]) == [128, 128], "the whole excess in one give-back"
    assert first.moved and not first.confirming
    assert await beat([first, second]) == [128, 128]
    assert not first.moved and not second.moved

    async def epochs() -> dict[int, tuple[str, int]]:
        rows = await pool.fetch("SELECT shard, owner, epoch FROM shard_leases")
        return {int(r["shard"]): (str(r["owner"]), int(r["epoch"])) for r in rows}

    settled = await epochs()
    for _ in range(5):
        await beat([first, second])
    assert await epochs() == settled, "a settled split moved"

    for leaser in (first, second):
        leaser.limit_steps()  # their keys are watched now
    assert await third.tick() == {}
    counts = await settle([first, second, third])
    assert len(counts) > 2, "given back in one go"
    for before, after in itertools.pairwise(counts):
        # at most a step given back per beat (the 256th shard is taken by whoever beats first)
        assert all(b - a <= first.step for b, a in zip(before[:2], after[:2], strict=True)), counts
        assert before[2] <= after[2]
    settled = await epochs()
    for _ in range(5):
        await beat([first, second, third])
    assert await epochs() == settled, "a settled split moved"
    owners = [owner for owner, _ in settled.values()]
    assert sorted(owners.count(name) for name in "abc") == [85, 85, 86]


async def test_join_leave_and_die(pool: asyncpg.Pool) -> None:
    workers = [ShardLeaser(pool, f"w{i}", LEASE_SECONDS) for i in range(3)]
    watches = [heartbeating(worker) for worker in workers]
    monitor = Monitor(workers)
    try:
        await watches[0].start()
        await until(lambda: covered(workers[:1], DEFAULT_SHARDS))
        await watches[1].start()
        await until(lambda: covered(workers[:2], fair_share(DEFAULT_SHARDS, 2)))
        await watches[2].start()
        await until(lambda: covered(workers, fair_share(DEFAULT_SHARDS, 3)))

        # a clean leave: the shards are given back and taken by the other two
        await watches[0].halt()
        await watches[0].release()
        await until(lambda: covered(workers[1:], fair_share(DEFAULT_SHARDS, 2)))

        # a death: w1 stops heartbeating without giving anything back
        orphans = workers[1].held()
        assert orphans
        died = time.monotonic()
        await watches[1].halt()
        await until(lambda: set(orphans) <= set(workers[2].held()))
        handover = time.monotonic() - died
        # design bound: the lease runs out, then the next heartbeat (lease/3) takes it
        assert handover < 2 * LEASE_SECONDS, handover
        for shard, epoch in orphans.items():
            assert workers[2].held()[shard] > epoch  # every change of owner bumps the epoch

        # the stalled worker wakes up: its late write on an old lease is refused and rolled back
        shard = next(iter(orphans))
        async with pool.acquire() as connection:
            await connection.execute("CREATE TABLE probe (shard INT)")
            with pytest.raises(StaleLease):
                async with connection.transaction():
                    await connection.execute("INSERT INTO probe VALUES ($1)", shard)
                    await check_lease(connection, "w1", Lease(shard, orphans[shard]))
            async with connection.transaction():
                current = Lease(shard, workers[2].held()[shard])
                await check_lease(connection, "w2", current)
                await connection.execute("INSERT INTO probe VALUES ($1)", shard)
            assert await connection.fetchval("SELECT count(*) FROM probe") == 1
    finally:
        for watch in watches:
            await watch.halt()
        await monitor.close()
    assert len(monitor.owners) >= DEFAULT_SHARDS


async def test_a_held_lease_blocks_takeover_until_the_write_commits(pool: asyncpg.Pool) -> None:
    """check_lease locks the lease row: a competing take waits for the writer's commit."""
    first = ShardLeaser(pool, "a", LEASE_SECONDS, shards=4)
    await first.tick()
    lease = Lease(0, first.held()[0])
    async with pool.acquire() as writer, pool.acquire() as thief, pool.acquire() as observer:
        thief_pid = thief.get_server_pid()
        async with writer.transaction():
            await check_lease(writer, "a", lease)
            take = asyncio.create_task(
                thief.execute(
                    "UPDATE shard_leases SET owner = 'b', epoch = epoch + 1 WHERE shard = 0"
                )
            )
            waiting = await observer.fetchval(
                "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
                thief_pid,
            )
            while not waiting and not take.done():
                waiting = await observer.fetchval(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
                    thief_pid,
                )
            assert not take.done()  # the take is blocked on the lease row, not finished
        await take
    async with pool.acquire() as connection, connection.transaction():
        with pytest.raises(StaleLease):
            await check_lease(connection, "a", lease)


async def test_check_lease_outside_a_transaction_is_a_bug(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as connection:
        with pytest.raises(RuntimeError):
            await check_lease(connection, "a", Lease(0, 1))


async def test_heartbeat_survives_a_lost_database_and_the_view_lapses(
    pool: asyncpg.Pool, postgres_server: PostgresServer, postgres_url: str
) -> None:
    """Cut the worker off: its belief in its leases lapses; reconnected, it takes them back."""
    name = postgres_url.rsplit("/", 1)[1]
    worker = ShardLeaser(pool, "lonely", LEASE_SECONDS, shards=8)
    watch = heartbeating(worker)
    admin = await asyncpg.connect(postgres_server.url())
    try:
        await watch.start()
        await until(lambda: len(worker.held()) == 8)
        await admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name
        )
        await until(lambda: worker.held() == {})
        await admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        await until(lambda: len(worker.held()) == 8)
    finally:
        await watch.halt()
        await admin.close()


async def test_a_slow_reshard_does_not_let_the_leases_lapse(pool: asyncpg.Pool) -> None:
    """Applying a shard change to the bridge can take longer than a lease (a million keys);
    renewals go on meanwhile, so the shards the worker keeps are not taken over."""
    applying, release = asyncio.Event(), asyncio.Event()
    calls = 0

    async def reshard(_owns: Callable[[str], bool]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the first change after start-up: hold it for several leases
            applying.set()
            await release.wait()

    first = ShardLeaser(pool, "slow", LEASE_SECONDS)
    watch = ShardWatch(first, reshard)
    other = ShardLeaser(pool, "other", LEASE_SECONDS)
    other_watch = heartbeating(other)
    monitor = Monitor([first, other])
    try:
        await watch.start()
        await until(lambda: covered([first], DEFAULT_SHARDS))
        await other_watch.start()  # `slow` gives half back, and its first reshard then hangs
        await asyncio.wait_for(applying.wait(), scaled(60))
        await until(lambda: covered([first, other], fair_share(DEFAULT_SHARDS, 2)))
        hung = time.monotonic()
        while time.monotonic() - hung < 3 * LEASE_SECONDS:
            assert len(first.held()) == fair_share(DEFAULT_SHARDS, 2), "the leases lapsed"
            await asyncio.sleep(0.05)
        assert covered([first, other], fair_share(DEFAULT_SHARDS, 2))
    finally:
        release.set()
        await watch.halt()
        await other_watch.halt()
        await other.release()
        await first.release()
        await monitor.close()


class _BreaksOnce(ShardLeaser):
    """A leaser whose third heartbeat fails with an error the heartbeat does not expect."""

    beats = 0

    async def tick(self) -> dict[int, int]:
        self.beats += 1
        if self.beats == 3:
            raise LookupError("not a database error")
        return await super().tick()


async def test_a_heartbeat_loop_that_fails_unexpectedly_is_restarted(pool: asyncpg.Pool) -> None:
    """Only database and network errors are expected by the heartbeat; any other one used to
    end the renewal task for good, so the worker's leases lapsed without a word. Supervised,
    the loop comes back, counted, and keeps the shards."""
    def restarts() -> float:
        return REGISTRY.get_sample_value("sigil_push_task_restarts_total", {"task": "shard-leases"}) or 0.0

    async def reshard(_owns: Callable[[str], bool]) -> None:
        return None

    leaser = _BreaksOnce(pool, "breaks", LEASE_SECONDS, shards=8)
    watch = ShardWatch(leaser, reshard)
    before = restarts()
    try:
        await watch.start()
        await until(lambda: restarts() > before)
        beats = leaser.beats
        await until(lambda: leaser.beats >= beats + 3)  # renewing again after the restart
        assert watch.held() == list(range(8))
        assert len(leaser.held()) == 8, "the leases lapsed"
    finally:
        await watch.halt()
        await leaser.release()


async def test_a_failed_reshard_is_applied_again_at_the_next_heartbeat(pool: asyncpg.Pool) -> None:
    """The bridge fails to apply the last change of a hand-over (its database busy, say): the
    next heartbeat applies it again, though the leases themselves changed no further."""
    shards = 8
    applied: list[int] = []

    async def reshard(owns: Callable[[str], bool]) -> None:
        count = sum(owns(f"{shard:08x}" + "00" * 28) for shard in range(shards))
        applied.append(count)
        if count == shards // 2 and applied.count(count) == 1:
            raise RuntimeError("the bridge could not apply it")

    first = ShardLeaser(pool, "first", LEASE_SECONDS, shards=shards)
    watch = ShardWatch(first, reshard)
    other = ShardLeaser(pool, "other", LEASE_SECONDS, shards=shards)
    other_watch = heartbeating(other)
    try:
        await watch.start()
        await other_watch.start()
        await until(lambda: applied.count(shards // 2) >= 2)
        assert watch.held() == sorted(first.held())
    finally:
        await watch.halt()
        await other_watch.halt()
        await other.release()
        await first.release()


class _CutOff(ShardLeaser):
    """A leaser whose heartbeats fail as with the database stopped, while `cut_off`."""

    cut_off = False

    async def tick(self) -> dict[int, int]:
        if self.cut_off:
            raise ConnectionRefusedError("the database is down")
        return await super().tick()


async def test_a_change_that_failed_half_way_is_applied_again_whole(pool: asyncpg.Pool) -> None:
    """A worker cut off from its database lets go of its shards a lease after its last
    renewal, and the bridge's change fails half way (the keys released, the database needed
    for the rest). When the heartbeats come back with the very same shards, the bridge is told
    them again, every one as gained. It used to be put back to believing it watched them:
    the same shards came back, no change was seen, and their keys stayed unwatched for good.
    Meanwhile the watch names the unreachable store for /health; afterwards, nothing."""
    shards = 8
    applied: list[ShardSet] = []

    async def reshard(owns: ShardSet) -> None:
        applied.append(owns)
        if not owns.held:
            raise ConnectionRefusedError("the bridge could not read its keys")

    leaser = _CutOff(pool, "cut", LEASE_SECONDS, shards=shards)
    watch = ShardWatch(leaser, reshard)
    every = frozenset(range(shards))
    try:
        await watch.start()
        assert [owns.held for owns in applied] == [every]
        leaser.cut_off = True
        await until(lambda: any(not owns.held for owns in applied))
        assert "the store (PostgreSQL) is unreachable" in watch.problems()["shard-leases"]
        failed = len(applied)
        leaser.cut_off = False
        await until(lambda: len(applied) > failed and applied[-1].held == every)
        assert applied[-1].gained == every, "the bridge must load every shard's keys again"
        await until(lambda: not watch.problems())
        assert watch.held() == list(range(shards))
    finally:
        await watch.halt()
        await leaser.release()


async def test_a_heartbeat_that_returns_late_does_not_make_the_bridge_reload(
    pool: asyncpg.Pool,
) -> None:
    """A heartbeat held up past the lease (here by a row lock; in production by an event loop
    busy loading a million keys) comes back with every shard confirmed by the database: the
    bridge keeps its keys instead of dropping them all and loading them again."""
    shards = 8
    applied: list[int] = []

    async def reshard(owns: Callable[[str], bool]) -> None:
        applied.append(sum(owns(f"{shard:08x}" + "00" * 28) for shard in range(shards)))

    leaser = ShardLeaser(pool, "busy", LEASE_SECONDS, shards=shards)
    watch = ShardWatch(leaser, reshard)
    await watch.start()
    assert applied == [shards]
    async with pool.acquire() as blocker, pool.acquire() as observer:
        try:
            async with blocker.transaction():
                await blocker.execute("SELECT 1 FROM workers WHERE worker_id = 'busy' FOR UPDATE")

                async def heartbeat_waits() -> bool:
                    return bool(await observer.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE '%INSERT INTO workers (worker_id)%'"
                    ))

                deadline = time.monotonic() + scaled(60)
                while not await heartbeat_waits():
                    assert time.monotonic() < deadline, "the heartbeat never reached the lock"
                    await asyncio.sleep(0.02)
                # the heartbeat began before it was seen waiting: once a lease has passed
                # since then, whatever it returns is already older than a lease
                waiting_since = time.monotonic()
                await until(lambda: time.monotonic() > waiting_since + LEASE_SECONDS)
                assert leaser.held() == {}  # the local view lapsed meanwhile
            await until(lambda: len(leaser.held()) == shards)  # the late heartbeat came back
            renewed = await observer.fetchval(
                "SELECT heartbeat_at FROM workers WHERE worker_id = 'busy'"
            )

            async def beat_again() -> bool:
                return bool(await observer.fetchval(
                    "SELECT heartbeat_at > $1 FROM workers WHERE worker_id = 'busy'", renewed
                ))

            deadline = time.monotonic() + scaled(60)
            while not await beat_again():
                assert time.monotonic() < deadline, "no heartbeat after the late one"
                await asyncio.sleep(0.02)
        finally:
            await watch.halt()
    assert applied == [shards], "the bridge was told to drop its keys and reload them"
    await leaser.release()


async def test_renewal_does_not_wait_for_the_takeover_of_an_expired_lease(
    pool: asyncpg.Pool,
) -> None:
    """A lease of ours that expired is locked by a worker taking it over (whose transaction
    may sit open while its event loop is busy): the heartbeat renews the rest and lets that
    one go, instead of waiting on the lock (past the lock timeout, failing the heartbeat)."""
    worker = ShardLeaser(pool, "a", LEASE_SECONDS, shards=4)
    assert sorted(await worker.tick()) == [0, 1, 2, 3]
    async with pool.acquire() as taker:
        await taker.execute(
            "UPDATE shard_leases SET expires_at = now() - interval '1 second' WHERE shard = 3"
        )
        async with taker.transaction():
            await taker.execute("SELECT 1 FROM shard_leases WHERE shard = 3 FOR UPDATE")
            held = await asyncio.wait_for(worker.tick(), scaled(30))
    assert sorted(held) == [0, 1, 2]
    assert sorted(await worker.tick()) == [0, 1, 2, 3]  # free again: taken back


async def test_workers_started_together_split_at_once_through_announcements(
    pool: asyncpg.Pool, postgres_url: str
) -> None:
    """Two workers started one after the other with a lease of 10 minutes (a heartbeat every
    200 s): the second's join and the first's give-back are announced over NOTIFY, each heard
    as a nudge, so the split reaches 128/128 in a few beats (the confirming one 0.5 s after
    the first that saw the newcomer), long before any heartbeat falls due; no shard moved more
    than once."""
    lease = 600.0
    leasers = [ShardLeaser(pool, f"w{i}", lease, confirm_seconds=0.5) for i in range(2)]
    stores = [PostgresDevices(PostgresDatabase(pool), leaser.worker_id) for leaser in leasers]

    async def reshard(_owns: Callable[[str], bool]) -> None:
        return None

    watches = [
        ShardWatch(leaser, reshard, announce=functools.partial(devices.announce, SHARDS_CHANNEL, "m"))
        for leaser, devices in zip(leasers, stores, strict=True)
    ]
    try:
        for watch, devices in zip(watches, stores, strict=True):
            await devices.listen(postgres_url)
            await devices.also_listen(SHARDS_CHANNEL, lambda _moved, w=watch: w.nudge())
        await watches[0].start()
        assert watches[0].held() == list(range(DEFAULT_SHARDS))
        await watches[1].start()
        await until(lambda: [len(watch.held()) for watch in watches] == [128, 128], timeout=120)
        assert covered(leasers, fair_share(DEFAULT_SHARDS, 2))
        owners = await pool.fetch("SELECT owner, epoch FROM shard_leases")
        # taken once by w0 (epoch 1); the half w1 holds moved once more (epoch 2)
        assert {(str(r["owner"]), int(r["epoch"])) for r in owners} == {("w0", 1), ("w1", 2)}
    finally:
        for watch in watches:
            await watch.halt()
        for leaser in leasers:
            await leaser.release()
        for devices in stores:
            await devices.close()
