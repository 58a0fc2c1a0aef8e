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
