"""The bridge's own Nostr key, used to answer NIP-42 AUTH challenges.

Taken from `server.secret_key` when set (the config has validated it); otherwise generated once and kept in the database so
relays see the same identity across restarts.
"""

from __future__ import annotations

import aiosqlite

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip19 import parse_secret_key

META_KEY = "bridge_secret_key"


async def bridge_key(connection: aiosqlite.Connection, configured: str) -> SecretKey:
    if configured:
        return SecretKey(parse_secret_key(configured))
    async with connection.execute("SELECT value FROM meta WHERE key = ?", (META_KEY,)) as cursor:
        row = await cursor.fetchone()
    if row is not None:
        return SecretKey(str(row[0]))
    key = SecretKey.generate()
    await connection.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?)", (META_KEY, key.secret_hex)
    )
    return key
