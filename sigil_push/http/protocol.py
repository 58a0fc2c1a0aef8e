"""The API's HTTP/1.1 protocol: uvicorn's httptools protocol with the bounds it lacks.

uvicorn closes an idle keep-alive connection, but has no deadline for receiving a request: a
client that sends half a request line and then a byte every few seconds holds its connection
(and a file descriptor) forever, and 200 of them were never closed. Here every request must
arrive whole, headers and body, within REQUEST_DEADLINE_SECONDS of the connection opening or
of the previous response; a connection that misses it is closed and counted. Header count and
size are bounded as they are parsed (past either: 400 and the connection closed), so no client
makes the server buffer more than a request's worth before the app is even called.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import Counter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REQUEST_DEADLINE_SECONDS = 10.0
MAX_HEADERS = 100
MAX_HEADER_BYTES = 16 * 1024
"""Request line plus header names and values."""
LIMIT_CONCURRENCY = 1024
"""uvicorn's `limit_concurrency`: past this many connections (or requests in flight) new
requests are answered 503 at once instead of queueing without bound."""

SLOW_CLOSED = Counter(
    "sigil_push_http_slow_requests_closed_total",
    "Connections closed for not sending a whole request within the deadline",
)
OVERSIZED = Counter(
    "sigil_push_http_oversized_headers_total",
    "Requests refused for too many header lines or too many header bytes",
)


class HeaderLimitExceeded(Exception):
    """Raised inside the parser's callback: httptools turns it into a 400 and a close."""


class BoundedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol plus the request deadline and the header bounds (module docstring)."""

    _deadline: asyncio.TimerHandle | None = None
    _header_count = 0
    _header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        self._header_count = 0
        self._header_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._count_header_bytes(len(name) + len(value))
        if self._header_count > MAX_HEADERS:
            OVERSIZED.inc()
            raise HeaderLimitExceeded("too many header lines")
        super().on_header(name, value)

    def on_message_complete(self) -> None:
        # the whole request is in: what follows is the app's time, not the client's
        self._cancel_deadline()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_deadline()

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_HEADER_BYTES:
            OVERSIZED.inc()
            raise HeaderLimitExceeded("headers too large")

    def _arm_deadline(self) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(REQUEST_DEADLINE_SECONDS, self._too_slow)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            SLOW_CLOSED.inc()
            self.transport.close()


def server_options() -> dict[str, Any]:
    """The uvicorn.Config options that install these bounds."""
    return {"http": BoundedHttpProtocol, "limit_concurrency": LIMIT_CONCURRENCY}
