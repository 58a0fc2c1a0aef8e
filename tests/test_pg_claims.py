"""The PostgreSQL outbox on a real server: enqueue once, claim without overlap, lapsed claims
come back, and a lost claim cannot be finished by its old holder."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from sigil_push.store.postgres.claims import Claim, claim_due, enqueue, finish, reschedule
from sigil_push.store.postgres.migrate import migrate

NOW = 1_800_000_000_000


@pytest.fixture
async def pool(postgres_url: str) -> AsyncIterator[asyncpg.Pool]:
    await migrate(postgres_url)
    async with asyncpg.create_pool(postgres_url, min_size=2, max_size=6) as created:
        yield created


async def add_device(pool: asyncpg.Pool, token: str) -> int:
    device_id = await pool.fetchval(
        "INSERT INTO devices (pubkey, platform, token, registered_at, updated_at)"
        " VALUES ($1, 'ios', $2, 0, 0) RETURNING id",
        "ab" * 32,
        token,
    )
    return int(device_id)


async def test_concurrent_enqueues_of_one_wakeup_store_one_row(pool: asyncpg.Pool) -> None:
    device = await add_device(pool, "t1")

    async def attempt() -> bool:
        async with pool.acquire() as connection:
            return await enqueue(connection, device, "e" * 64, "wss://r", None, NOW)

    results = await asyncio.gather(*(attempt() for _ in range(6)))
    assert sorted(results) == [False] * 5 + [True]
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 1


async def test_two_claimers_never_claim_one_row_twice(pool: asyncpg.Pool) -> None:
    devices = [await add_device(pool, f"t{i}") for i in range(10)]
    async with pool.acquire() as connection:
        for n in range(400):
            assert await enqueue(connection, devices[n % 10], f"{n:064x}", "wss://r", None, NOW)

    async def drain(worker: str) -> list[Claim]:
        claimed: list[Claim] = []
        async with pool.acquire() as connection:
            while batch := await claim_due(connection, worker, 7, 60_000, NOW):
                claimed.extend(batch)
                await asyncio.sleep(0)  # let the other claimer interleave
        return claimed

    first, second = await asyncio.gather(drain("a"), drain("b"))
    ids_a, ids_b = {c.id for c in first}, {c.id for c in second}
    assert not ids_a & ids_b
    assert len(ids_a) + len(ids_b) == len(first) + len(second) == 400
    assert all(claim.attempts == 1 for claim in first + second)


async def test_a_claim_in_progress_is_skipped_not_waited_for(pool: asyncpg.Pool) -> None:
    device = await add_device(pool, "t1")
    async with pool.acquire() as connection:
        for n in range(6):
            await enqueue(connection, device, f"{n:064x}", "wss://r", None, NOW)
    async with pool.acquire() as slow, pool.acquire() as fast:
        async with slow.transaction():  # claimed rows stay locked until this commits
            held = await claim_due(slow, "slow", 3, 60_000, NOW)
            other = await asyncio.wait_for(claim_due(fast, "fast", 10, 60_000, NOW), 30)
            assert len(held) == 3 and len(other) == 3
            assert not {c.id for c in held} & {c.id for c in other}
        assert await claim_due(fast, "fast", 10, 60_000, NOW) == []


async def test_a_lapsed_claim_is_reclaimed_and_the_old_holder_cannot_finish(
    pool: asyncpg.Pool,
) -> None:
    device = await add_device(pool, "t1")
    async with pool.acquire() as connection:
        await enqueue(connection, device, "f" * 64, "wss://r", '{"id":"x"}', NOW)
        (dead,) = await claim_due(connection, "killed", 10, 30_000, NOW)
        assert await claim_due(connection, "other", 10, 30_000, NOW + 29_999) == []
        (again,) = await claim_due(connection, "other", 10, 30_000, NOW + 30_000)
        assert again.id == dead.id and again.attempts == 2 and again.event_json == '{"id":"x"}'
        assert not await finish(connection, "killed", dead)  # its claim is gone
        assert not await reschedule(connection, "killed", dead, NOW + 1)
        assert await finish(connection, "other", again)
        assert await pool.fetchval("SELECT count(*) FROM outbox") == 0


async def test_reschedule_releases_until_the_next_attempt(pool: asyncpg.Pool) -> None:
    device = await add_device(pool, "t1")
    async with pool.acquire() as connection:
        await enqueue(connection, device, "f" * 64, "wss://r", None, NOW)
        (claim,) = await claim_due(connection, "a", 10, 30_000, NOW)
        assert await reschedule(connection, "a", claim, NOW + 5_000)
        assert await claim_due(connection, "b", 10, 30_000, NOW + 4_999) == []
        (later,) = await claim_due(connection, "b", 10, 30_000, NOW + 5_000)
        assert later.id == claim.id
        # with the database's own clock, a row due in the past is claimable
        await reschedule(connection, "b", later, 0)
        assert [c.id for c in await claim_due(connection, "c", 10, 30_000)] == [claim.id]


async def test_bad_claim_arguments_are_refused(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as connection:
        with pytest.raises(ValueError):
            await claim_due(connection, "a", 0, 1000)
