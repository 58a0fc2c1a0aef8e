"""Baselines and cursors of relays the bridge no longer uses leave memory (issue 22): they were
kept for every relay ever used, so a public instance's users naming relay after relay grew them
without end. The store keeps them: a relay that comes back reads its keys' stored baselines and
its cursor before its first REQ, and catches up from where it was instead of baselining anew.
In process, on a SQLite file; the relays are in-process websocket servers that answer EOSE."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY
from websockets.asyncio.server import ServerConnection

from sigil_push.nostr.keys import SecretKey
from testkit.deadlines import scaled
from testkit.in_process import InProcessBridge, in_process_bridge
from tests.adversarial.hostile import HostileRelay, eventually, hostile_relay

RELAYS = 5


def entries(structure: str) -> float:
    return REGISTRY.get_sample_value("sigil_push_memory_entries", {"structure": structure}) or 0.0


async def _stored(parts: InProcessBridge, url: str, key: str) -> bool:
    baselined, cursor = await parts.bridge._relays.stored_relay_state(url, [key])
    return key in baselined and cursor is not None


async def test_dropped_relays_free_their_state_and_catch_up_when_they_return(
    tmp_path: Path,
) -> None:
    answering = True

    async def eose(relay: HostileRelay, ws: ServerConnection, frame: Any) -> None:
        if frame[0] == "REQ" and answering:
            await ws.send(json.dumps(["EOSE", frame[1]]))

    user = SecretKey.generate()
    key = user.public_key_hex
    async with AsyncExitStack() as stack:
        relays = [await stack.enter_async_context(hostile_relay(eose)) for _ in range(RELAYS)]
        urls = [relay.url for relay in relays]
        async with in_process_bridge(
            tmp_path, "push.db", server={"allow_insecure_relays": True}
        ) as parts:
            pool = parts.bridge._pool
            level = (entries("relay_baselines"), entries("relay_cursors"))
            await parts.devices.register(key, "android", "fcm-drop", "opaque", urls, None, 0)
            await eventually(
                lambda: entries("relay_baselines") >= level[0] + RELAYS
                and entries("relay_cursors") >= level[1] + RELAYS,
                "the key baselined on every relay, each with a cursor", timeout=60.0,
            )
            await parts.bridge.save_cursors()
            for url in urls:  # the committer has stored the baselines
                deadline = asyncio.get_running_loop().time() + scaled(60.0)
                while not await _stored(parts, url, key):
                    assert asyncio.get_running_loop().time() < deadline, "never stored"
                    await asyncio.sleep(0.05)

            await parts.devices.register(key, "android", "fcm-drop", "opaque", [], None, 0)
            await eventually(lambda: not set(urls) & set(parts.bridge.health()),
                             "the relays dropped", timeout=60.0)
            await eventually(
                lambda: (entries("relay_baselines"), entries("relay_cursors")) == level,
                "baselines and cursors back to their level", timeout=60.0,
            )

            # one comes back and never answers EOSE again: the key is baselined there only
            # because its stored baseline was read back, and its REQ asks from the cursor
            answering = False
            back = urls[0]
            await parts.devices.register(key, "android", "fcm-drop", "opaque", [back], None, 0)
            await eventually(lambda: back in pool.subs and key in pool.subs[back].baselined,
                             "the stored baseline read back", timeout=60.0)
            assert back in pool.cursors
            assert entries("relay_baselines") == level[0] + 1
