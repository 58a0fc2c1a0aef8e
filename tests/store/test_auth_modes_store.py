"""Learned NIP-42 modes in the store, on both engines: saved, replaced, and forgotten when old."""

from __future__ import annotations

import time

from sigil_push.store.auth_modes import MAX_AGE_SECONDS, LearnedAuthModes
from sigil_push.store.factory import PostgresStore, SqliteStore


async def test_a_verdict_is_kept_replaced_and_expires(store: SqliteStore | PostgresStore) -> None:
    modes = LearnedAuthModes(store.auth_modes)
    assert await modes.load() == {}
    await modes.save("wss://a.example", "multi")
    await modes.save("wss://b.example", "single")
    assert await modes.load() == {"wss://a.example": "multi", "wss://b.example": "single"}

    # a multi relay that turned out to keep one key per connection is saved as single
    await modes.save("wss://a.example", "single")
    assert (await modes.load())["wss://a.example"] == "single"

    # a day past the age limit both verdicts are too old to trust: the relays get probed again
    assert await modes.load(now=time.time() + MAX_AGE_SECONDS + 86400) == {}
