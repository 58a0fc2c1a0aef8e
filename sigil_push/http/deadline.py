"""The bound on how long a request that reads or writes the store may take (issue 34, item 9):
every such route, the Iris ones included, answers `503 unavailable` within 10 s whatever the
database does, never a hang."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from sigil_push.errors import ApiError

log = logging.getLogger(__name__)

STORE_DEADLINE_SECONDS = 6.0
"""The most a route that reads or writes the store may take before it answers `503
unavailable`: within 10 s whatever the database does. A statement waits at most 5 s for a lock
(SQLite's busy timeout, PostgreSQL's lock_timeout), but a request runs several, and on SQLite
each queues on the shared connection behind the background loops' statements, each waiting
out its own busy timeout while another connection holds the file's lock (9-14 s, and more).
The other 4 s are for what the deadline doesn't cover (accepting the connection, reading the
request, writing the answer), which a busy host slows: with 8 s a locked SQLite's 503 took
10.3 s on a 2-core machine running two test suites."""

Handler = Callable[[Request], Awaitable[Response]]


def store_deadline(handler: Handler) -> Handler:
    """`handler` answering `503 unavailable` once it has run STORE_DEADLINE_SECONDS. What it
    had sent the store may still be applied (as after a client's own timeout): every route is
    safe to retry with the same auth event (CONTRACT 3, idempotent retries; a retried Iris
    `POST /subscriptions` answers the id the first one created). Logged like the store's own
    busy errors (api._error_response): which of the two answers first depends on the load."""

    @functools.wraps(handler)
    async def bounded(request: Request) -> Response:
        try:
            async with asyncio.timeout(STORE_DEADLINE_SECONDS) as deadline:
                return await handler(request)
        except TimeoutError:
            if not deadline.expired():
                raise
            log.warning("storage busy on %s %s: no answer in %.0f s",
                        request.method, request.url.path, STORE_DEADLINE_SECONDS)
            raise ApiError(
                503, "unavailable", "storage did not answer in time; retry shortly",
                {"Retry-After": "1"},
            ) from None

    return bounded
