"""Single use of NIP-98 auth events: an auth event is spent on one request, then remembered.

Single use is about the whole auth event, id and signature: a client that signs without a
`payload` tag (Iris) makes the same event id for two requests in one second, and only the
key's owner can sign that id a second time. The same auth event is accepted again only for the
very same request (method, URL and body, as `request` digests them): an idempotent retry, never
another body.

Events are kept a little longer than the clock-skew window, after which the timestamp check
alone rejects them, so the table stays small; expired rows are pruned in passing, at most once
a minute. Claims that arrive while a write is in flight are written together in one
statement: under load the replay check costs one round trip per batch, not per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from sigil_push.nostr.nip98 import MAX_CLOCK_SKEW_SECONDS
from sigil_push.store.interface import AuthClaim, AuthIdRows

RETENTION_SECONDS = 2 * MAX_CLOCK_SKEW_SECONDS + 60
PRUNE_INTERVAL_SECONDS = 60.0
MAX_BATCH = 500


def request_digest(method: str, url: str, body: bytes) -> str:
    """What an auth event was spent on: hex SHA-256 of the method, the URL and the body."""
    digest = hashlib.sha256(f"{method.upper()} {url}\n".encode())
    digest.update(body)
    return digest.hexdigest()


class UsedAuthIds:
    """`AuthIdStore`: the batching here, the rows in the engine's `AuthIdRows`."""

    def __init__(self, rows: AuthIdRows) -> None:
        self._rows = rows
        self._last_prune = time.monotonic()
        self._waiting: dict[tuple[str, str], tuple[str, asyncio.Future[bool]]] = {}
        self._writer: asyncio.Task[None] | None = None

    async def claim(self, event_id: str, sig: str, request: str) -> bool:
        """Spend the auth event (`event_id`, `sig`) on `request`; False when it was already
        spent on another request."""
        key = (event_id, sig)
        waiting = self._waiting.get(key)
        if waiting is not None:
            # the same event racing itself: a retry of the same request shares the answer
            return request == waiting[0] and await asyncio.shield(waiting[1])
        claimed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[key] = (request, claimed)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_waiting())
        return await asyncio.shield(claimed)

    async def _write_waiting(self) -> None:
        while self._waiting:
            batch = dict(list(self._waiting.items())[:MAX_BATCH])
            for key in batch:
                del self._waiting[key]
            claims = [AuthClaim(event_id, sig, request) for (event_id, sig), (request, _) in batch.items()]
            try:
                if time.monotonic() - self._last_prune > PRUNE_INTERVAL_SECONDS:
                    await self.prune()
                expires_at = int(time.time()) + RETENTION_SECONDS
                accepted = await self._rows.claim(claims, expires_at)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure
                for _, future in batch.values():
                    future.set_exception(exc)
                continue
            for key, (_, future) in batch.items():
                future.set_result(key in accepted)

    async def prune(self) -> int:
        self._last_prune = time.monotonic()
        return await self._rows.prune(int(time.time()))
