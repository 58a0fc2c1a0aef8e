"""Single use of NIP-98 auth ids, against a real SQLite file."""

from __future__ import annotations

import time
from pathlib import Path

from sigil_push.auth_ids import UsedAuthIds
from sigil_push.db import open_database


async def test_an_id_is_claimed_once_and_expired_ids_are_pruned(tmp_path: Path) -> None:
    db = await open_database(tmp_path / "ids.db")
    try:
        ids = UsedAuthIds(db)
        assert await ids.claim("a" * 64)
        assert not await ids.claim("a" * 64)
        await db.execute(
            "INSERT INTO nip98_used VALUES (?, ?)", ("b" * 64, int(time.time()) - 1)
        )
        assert await ids.prune() == 1
        assert not await ids.claim("a" * 64)
    finally:
        await db.close()


async def test_concurrent_claims_of_the_same_id_admit_exactly_one(tmp_path: Path) -> None:
    """Two requests racing with one auth event: one wins, whether batched together or not."""
    import asyncio

    db = await open_database(tmp_path / "ids.db")
    try:
        ids = UsedAuthIds(db)
        results = await asyncio.gather(*(ids.claim(f"{i % 50:064x}") for i in range(200)))
        assert sum(results) == 50
        again = await asyncio.gather(*(ids.claim(f"{i:064x}") for i in range(60)))
        assert again == [False] * 50 + [True] * 10
    finally:
        await db.close()
