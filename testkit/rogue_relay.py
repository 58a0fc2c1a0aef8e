"""A relay that breaks the protocol on purpose, speaking just enough NIP-01 to be subscribed to.

On every REQ it answers EOSE at once (so what follows is "live"), then sends junk frames, then
the events it was given, and on the first connection only, a frame larger than any relay limit.
It runs in the test's own event loop on 127.0.0.1.
"""

from __future__ import annotations

import json
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from testkit.loopback_relay import LoopbackRelay

JUNK_FRAMES: list[str | bytes] = [
    "not json at all",
    b"\x00\x01binary",
    '{"an": "object"}',
    '["EVENT"]',
    '["EVENT", "sub", "not an event"]',
    '["EVENT", "sub", {"id": "short"}]',
    '["WHATEVER", 1, 2]',
    "[]",
]
OVERSIZED_BYTES = 5 * 1024 * 1024


class RogueRelay(LoopbackRelay):
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.connections = 0

    def _serve_options(self) -> dict[str, Any]:
        return {"max_size": None}

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        try:
            await self._serve(ws, first_connection=self.connections == 1)
        except ConnectionClosed:
            return

    async def _serve(self, ws: ServerConnection, first_connection: bool) -> None:
        async for text in ws:
            message = json.loads(text)
            if message[0] != "REQ":
                continue
            sub_id = message[1]
            await ws.send(json.dumps(["EOSE", sub_id]))
            for junk in JUNK_FRAMES:
                await ws.send(junk)
            for event in self.events:
                await ws.send(json.dumps(["EVENT", sub_id, event]))
            if first_connection:
                await ws.send('["NOTICE", "' + "x" * OVERSIZED_BYTES + '"]')
