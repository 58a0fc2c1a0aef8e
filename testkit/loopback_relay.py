"""The part every hand-written test relay shares: a websockets server on 127.0.0.1, run in the
test's own event loop as an async context manager, with its `ws://` URL once started."""

from __future__ import annotations

from typing import Any, Self

from websockets.asyncio.server import Server, ServerConnection, serve


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
