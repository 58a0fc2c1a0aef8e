"""A thin protocol layer in front of a real relay that swallows gift wraps.

Everything passes through both ways, except a client's `EVENT` of kind 1059: the layer answers
`OK true` itself and never hands it on, so the write looks accepted but no subscriber ever gets
it. This is the failure the canary exists to catch: a relay that is up, subscribed to and
answering, and still not delivering DMs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from testkit.loopback_relay import LoopbackRelay


class GiftWrapDroppingRelay(LoopbackRelay):
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.swallowed: list[str] = []

    async def _handle(self, ws: ServerConnection) -> None:
        async with connect(self.upstream, proxy=None, max_size=None) as upstream:
            tasks = [
                asyncio.create_task(self._from_client(ws, upstream)),
                asyncio.create_task(self._to_client(ws, upstream)),
            ]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await task

    async def _from_client(self, ws: ServerConnection, upstream: ClientConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                message = json.loads(frame)
                if message[0] == "EVENT" and message[1].get("kind") == 1059:
                    self.swallowed.append(message[1]["id"])
                    await ws.send(json.dumps(["OK", message[1]["id"], True, ""]))
                    continue
                await upstream.send(frame)

    async def _to_client(self, ws: ServerConnection, upstream: ClientConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in upstream:
                await ws.send(frame)
