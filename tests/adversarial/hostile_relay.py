"""A hostile relay that ignores filters: on every REQ it answers EOSE (so what follows is live)
and then serves every event it holds, whoever they are for. Runs on 127.0.0.1 in the test's
own event loop."""

from __future__ import annotations

import json
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from testkit.loopback_relay import LoopbackRelay


class ReplayRelay(LoopbackRelay):
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.requests = 0

    async def _handle(self, ws: ServerConnection) -> None:
        try:
            async for text in ws:
                message = json.loads(text)
                if message[0] != "REQ":
                    continue
                self.requests += 1
                await ws.send(json.dumps(["EOSE", message[1]]))
                for event in self.events:
                    await ws.send(json.dumps(["EVENT", message[1], event]))
        except ConnectionClosed:
            return
