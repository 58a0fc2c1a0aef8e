"""Cross-cutting limits that wrap providers instead of living inside each of them.

`ConcurrencyLimited` caps the pushes in flight per provider (a slow provider must not hold
every socket).
"""

from __future__ import annotations

import asyncio
from collections import deque

from sigil_push.push.base import Outcome, Sender, WakeupMessage
from sigil_push.push.metrics import IN_FLIGHT
from sigil_push.store.records import Device


class ConcurrencyLimited:
    """A Sender that lets at most `limit` (0: the provider's own maximum) sends run at once.

    A send that finds a free slot takes it with one increment: delivery starts no more sender
    tasks than the limit, so that is every send there, and an asyncio.Semaphore's acquire and
    release were a measurable share of a push. Beyond the limit, sends wait in arrival order
    and a finishing send hands its slot straight to the first of them. The in-flight gauge
    reads the same counter when scraped.
    """

    def __init__(self, inner: Sender, limit: int) -> None:
        self.inner = inner
        self.platform = inner.platform
        self.provider = inner.provider
        self.max_concurrency = min(limit, inner.max_concurrency) if limit > 0 else inner.max_concurrency
        self._sending = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        IN_FLIGHT.labels(inner.provider).set_function(lambda: self._sending)

    def fits(self, data: dict[str, str]) -> bool:
        return self.inner.fits(data)

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        if self._sending >= self.max_concurrency or self._waiting:
            await self._turn()
        else:
            self._sending += 1
        try:
            return await self.inner.send(message, device)
        finally:
            self._release()

    async def _turn(self) -> None:
        """Wait until a finishing send hands over its slot (it stays counted in `_sending`)."""
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # handed a slot just as it was cancelled: pass it on
            elif turn in self._waiting:
                self._waiting.remove(turn)
            raise

    def _release(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._sending -= 1

    async def close(self) -> None:
        await self.inner.close()
