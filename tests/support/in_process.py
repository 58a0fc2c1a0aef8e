"""One in-process Bridge over a real SQLite file, for tests that feed it relay input directly
(no relay process, no service): the set-up and tear-down those tests share.

The Bridge is wired as the service wires it (the devices notify it of registrations) and
started; on exit it is stopped before the observation log and the database close.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite

from sigil_push.bridge import Bridge
from sigil_push.config import parse_config
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog
from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.devices import Devices
from sigil_push.store.sqlite.outbox import Outbox


@dataclass
class InProcessBridge:
    """The parts a test reaches into: the database, the log, the store halves, the bridge."""

    db: aiosqlite.Connection
    observations: ObservationLog
    devices: Devices
    outbox: Outbox
    bridge: Bridge


@asynccontextmanager
async def in_process_bridge(
    folder: Path,
    relays: list[dict[str, Any]] | None = None,
) -> AsyncIterator[InProcessBridge]:
    """A started `Bridge` with its database (`push.db`) and observation log in `folder`;
    `relays` are the config's `[[relay]]` tables (none: only users' own relays)."""
    document: dict[str, Any] = {"server": {"database": "push.db"}}
    if relays:
        document["relay"] = relays
    config = parse_config(document, folder / "relays.toml")
    db = await open_database(folder / "push.db")
    observations = ObservationLog(folder / "observations")
    await observations.start()
    devices = Devices(db)
    outbox = Outbox(db)
    bridge = Bridge(config, devices, outbox, observations, SecretKey.generate())
    devices.add_listener(bridge.registration_changed)
    await bridge.start()
    try:
        yield InProcessBridge(db, observations, devices, outbox, bridge)
    finally:
        await bridge.stop()
        await observations.stop()
        await db.close()
