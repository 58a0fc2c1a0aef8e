"""`migrate --from` moves an old SQLite instance onto PostgreSQL; an instance from before key
files may still hold the bridge's own key in `meta`. It once went along into PostgreSQL, where
every backup would carry the bridge's identity. It stays behind now, and the command says
where it belongs (`server.secret_key_file`). Real CLI, real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from sigil_push.nostr.keys import SecretKey
from sigil_push.store.factory import open_sqlite
from testkit.cli import run_cli


async def test_the_bridge_key_is_never_copied_into_postgres(
    tmp_path: Path, postgres_url: str
) -> None:
    old = tmp_path / "old.db"
    store = await open_sqlite(old)
    try:
        await store.db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?)",
            ("bridge_secret_key", SecretKey.generate().secret_hex),
        )
        await store.db.commit()
    finally:
        await store.close()
    config = tmp_path / "relays.toml"
    config.write_text(f'[server]\ndatabase = "{postgres_url}"\n')

    result = run_cli("migrate", "--config", str(config), "--from", str(old))

    assert result.returncode == 0, result.stderr
    assert "secret_key_file" in result.stderr
    connection = await asyncpg.connect(postgres_url)
    try:
        keys = [row["key"] for row in await connection.fetch("SELECT key FROM meta")]
    finally:
        await connection.close()
    assert "bridge_secret_key" not in keys
