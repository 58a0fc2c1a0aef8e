"""The part every hand-written test relay shares: a websockets server on 127.0.0.1, run in the
test's own event loop as an async context manager, with its `ws://` URL once started; and a
proxy in front of a real relay, for tests that watch or bend what passes."""

from __future__ import annotations

import asyncio
from typing import Any, Self

from websockets.asyncio.client import connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed


class LoopbackRelay:
    url = ""
    _server: Server | None = None

    def _serve_options(self) -> dict[str, Any]:
        """Extra keyword arguments for `websockets.serve` (size limits, HTTP answers)."""
        return {}

    async def _handle(self, ws: ServerConnection) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self._server = await serve(
            self._handle, "127.0.0.1", 0, compression=None, **self._serve_options()
        )
        port = next(iter(self._server.sockets)).getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class ProxyRelay(LoopbackRelay):
    """Forwards each client connection to the relay at `upstream`, frame by frame, both ways.
    A subclass sees each frame the client sends (`client_frame`: it may answer it itself, or
    hold it, and says whether it goes on) and each frame the relay sends (`relay_frame`).
    `cut` drops every client connection (a network blip: the relay itself keeps running)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._sockets: set[ServerConnection] = set()

    async def cut(self) -> None:
        for ws in list(self._sockets):
            await ws.close()

    async def client_frame(self, ws: ServerConnection, frame: str | bytes) -> bool:
        """True: pass `frame` on to the relay."""
        return True

    def relay_frame(self, frame: str | bytes) -> None:
        """Sees a frame the relay sends, before the client gets it."""

    async def _handle(self, ws: ServerConnection) -> None:
        self._sockets.add(ws)
        try:
            await self._relay(ws)
        finally:
            self._sockets.discard(ws)

    async def _relay(self, ws: ServerConnection) -> None:
        async with connect(self.upstream, proxy=None, max_size=None) as upstream:

            async def downstream() -> None:
                async for frame in upstream:
                    self.relay_frame(frame)
                    await ws.send(frame)

            relaying = asyncio.create_task(downstream())
            try:
                async for frame in ws:
                    if await self.client_frame(ws, frame):
                        await upstream.send(frame)
            except ConnectionClosed:
                pass
            finally:
                relaying.cancel()
