"""The device store against a real SQLite file: limits under concurrency, moving tokens."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from sigil_push.db import open_database
from sigil_push.devices import Devices, TooManyDevices


async def test_device_limit_holds_under_concurrent_registrations(tmp_path: Path) -> None:
    """Without a lock, the limit is enforced by the writing statement itself."""
    db = await open_database(tmp_path / "devices.db")
    try:
        devices = Devices(db)
        pubkey = secrets.token_hex(32)

        async def attempt() -> bool:
            try:
                await devices.register(pubkey, "ios", secrets.token_hex(32), "opaque", (), None, 10)
                return True
            except TooManyDevices:
                return False

        outcomes = await asyncio.gather(*(attempt() for _ in range(40)))
        assert sum(outcomes) == 10
        assert len(await devices.of_pubkey(pubkey)) == 10
    finally:
        await db.close()


async def test_re_registering_an_owned_token_does_not_count_against_the_limit(tmp_path: Path) -> None:
    db = await open_database(tmp_path / "devices.db")
    try:
        devices = Devices(db)
        pubkey, other = secrets.token_hex(32), secrets.token_hex(32)
        tokens = [secrets.token_hex(32) for _ in range(2)]
        for token in tokens:
            await devices.register(pubkey, "ios", token, "opaque", (), None, 2)
        again = await devices.register(pubkey, "ios", tokens[0], "event_id", (), None, 2)
        assert not again.created and again.device.payload == "event_id"
        changed: list[str] = []
        devices.add_listener(changed.append)
        moved = await devices.register(other, "ios", tokens[1], "opaque", (), None, 2)
        assert moved.previous_pubkey == pubkey
        assert sorted(changed) == sorted([pubkey, other])
        assert [d.token for d in await devices.of_pubkey(pubkey)] == [tokens[0]]
    finally:
        await db.close()
