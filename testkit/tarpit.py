"""A hostile push endpoint: accepts TCP connections on 127.0.0.1 and never answers."""

from __future__ import annotations

import asyncio
from typing import Self


class Tarpit:
    def __init__(self) -> None:
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        await reader.read()  # until the client gives up; never a byte back

    def endpoint(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/up/{name}"

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._hold, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
