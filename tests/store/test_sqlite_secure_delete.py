"""How SQLite clears deleted bytes: `secure_delete = FAST` on every connection the store opens,
whatever the SQLite build's default (Debian builds it ON, which writes every page a delete
frees: for sealed wakeups, whose outbox rows carry a ~2 KB event, about a page per settled
push). The one secret that must leave no trace still gets ON for its own statement."""

from __future__ import annotations

from pathlib import Path

from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.instance import SqliteMeta

FAST = 2  # what `PRAGMA secure_delete` reads back for FAST (0 OFF, 1 ON)


async def _mode(db: object) -> int:
    [(mode,)] = await db.execute_fetchall("PRAGMA secure_delete")  # type: ignore[attr-defined]
    return int(mode)


async def test_an_opened_database_zeroes_deletes_only_in_pages_it_writes_anyway(
    tmp_path: Path,
) -> None:
    db = await open_database(tmp_path / "push.db")
    try:
        assert await _mode(db) == FAST
    finally:
        await db.close()


async def test_a_secure_delete_zeroes_its_row_and_leaves_ordinary_deletes_fast(
    tmp_path: Path,
) -> None:
    path = tmp_path / "push.db"
    db = await open_database(path)
    try:
        meta = SqliteMeta(db)
        secret = "5e" * 32
        await meta.put_if_absent("doomed", secret)
        await meta.delete_securely("doomed")
        assert await meta.get("doomed") is None
        assert await _mode(db) == FAST
        await db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        await db.close()
    assert secret.encode() not in path.read_bytes()
