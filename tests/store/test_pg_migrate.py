"""PostgreSQL migrations against a real server: applied once, serialised, newer refused."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from sigil_push.store.postgres.migrate import (
    MIGRATION_LOCK_KEY,
    Migration,
    MigrationError,
    available,
    migrate,
    migrate_connection,
)


async def test_applies_every_migration_once(postgres_url: str) -> None:
    names = [migration.name for migration in available()]
    assert names and names[0].startswith("0001_")
    assert await migrate(postgres_url) == names
    assert await migrate(postgres_url) == []
    connection = await asyncpg.connect(postgres_url)
    try:
        versions = [
            row[0]
            for row in await connection.fetch(
                "SELECT version FROM schema_migrations ORDER BY version"
            )
        ]
        assert versions == [migration.version for migration in available()]
        tables = {
            row[0]
            for row in await connection.fetch(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
            )
        }
        assert {
            "devices",
            "outbox",
            "seen_events",
            "nip98_used",
            "shard_leases",
            "workers",
            "auth_signers",
            "relay_cursors",
        } <= tables
    finally:
        await connection.close()


async def test_concurrent_runners_do_not_double_apply(postgres_url: str) -> None:
    # A migration that is not idempotent: run twice, its INSERT would break the primary key.
    slow = Migration(
        9001,
        "9001_probe.sql",
        "CREATE TABLE probe (id INT PRIMARY KEY); SELECT pg_sleep(0.3);"
        " INSERT INTO probe VALUES (1);",
    )
    plan = [*available(), slow]
    first, second = await asyncpg.connect(postgres_url), await asyncpg.connect(postgres_url)
    try:
        results = await asyncio.gather(
            migrate_connection(first, plan), migrate_connection(second, plan)
        )
        assert sorted(len(applied) for applied in results) == [0, len(plan)]
        assert await first.fetchval("SELECT count(*) FROM probe") == 1
    finally:
        await first.close()
        await second.close()


async def test_newer_database_is_refused(postgres_url: str) -> None:
    await migrate(postgres_url)
    connection = await asyncpg.connect(postgres_url)
    try:
        await connection.execute(
            "INSERT INTO schema_migrations (version, name) VALUES (9999, '9999_future.sql')"
        )
        with pytest.raises(MigrationError, match="9999"):
            await migrate_connection(connection)
    finally:
        await connection.close()
    other = await asyncpg.connect(postgres_url)
    try:  # the refusal released the lock: another runner can still take it
        assert await other.fetchval("SELECT pg_try_advisory_lock($1)", MIGRATION_LOCK_KEY)
    finally:
        await other.close()
