"""A scripted relay for tests: a websockets server on a loopback port, in a thread with its
own event loop (`start`/`stop`), so that a `sigil-push serve` process under test, or the test's
own loop, pays for what it reads and the relay does not share that loop's time. A subclass
answers each client connection in `handle`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Self

from websockets.asyncio.server import ServerConnection, serve

from testkit.deadlines import STARTUP_SECONDS, STOP_SECONDS, scaled


class ThreadedRelay:
    def __init__(self) -> None:
        self.url = ""
        """`ws://127.0.0.1:<port>` once started."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._listening = threading.Event()
        self._stop: asyncio.Event | None = None
        self._serving: concurrent.futures.Future[None] | None = None

    async def handle(self, ws: ServerConnection) -> None:
        """One client connection, on the relay's loop, until either side closes it."""
        raise NotImplementedError

    def start(self) -> Self:
        """Listen; returns once `url` accepts connections."""
        self._thread.start()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        if not self._listening.wait(scaled(STARTUP_SECONDS)):
            raise TimeoutError(f"{type(self).__name__} did not start listening")
        return self

    def stop(self) -> None:
        """Close the server (and the connections still open), then end the thread."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._serving is not None:
            self._serving.result(scaled(STOP_SECONDS))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=scaled(STOP_SECONDS))

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with serve(self.handle, "127.0.0.1", 0, compression=None, max_size=None) as server:
            self.url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
            self._listening.set()
            await self._stop.wait()
