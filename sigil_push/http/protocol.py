"""The API's HTTP/1.1 protocol: uvicorn's httptools protocol with the bounds it lacks.

uvicorn closes an idle keep-alive connection, but has no deadline for receiving a request: a
client that sends half a request line and then a byte every few seconds holds its connection
(and a file descriptor) forever, and 200 of them were never closed. Here every request must
arrive whole, headers and body, within REQUEST_DEADLINE_SECONDS of the connection opening or
of the previous response; a connection that misses it is closed and counted. Header count and
size are bounded as they are parsed (past either: 400 and the connection closed), so no client
makes the server buffer more than a request's worth before the app is even called.

What this layer answers by itself is JSON like every other refusal (`{"error", "message"}`,
with the CORS allow-origin header): uvicorn's own answers are plain text, so a request HTTP
refuses (a `Content-Length` that is not a number, a malformed request line, the header bounds)
got `400 Invalid HTTP request received.`, and one past the concurrency limit
`503 Service Unavailable`, which a client parsing every error as JSON cannot read.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from prometheus_client import Counter
from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

REQUEST_DEADLINE_SECONDS = 10.0
MAX_HEADERS = 100
MAX_HEADER_BYTES = 16 * 1024
"""Request line plus header names and values."""
LIMIT_CONCURRENCY = 1024
"""Past this many connections (or requests in flight) new requests are answered 503 at once
instead of queueing without bound (uvicorn's `limit_concurrency` rule, answered in JSON)."""

SLOW_CLOSED = Counter(
    "sigil_push_http_slow_requests_closed_total",
    "Connections closed for not sending a whole request within the deadline",
)
OVERSIZED = Counter(
    "sigil_push_http_oversized_headers_total",
    "Requests refused for too many header lines or too many header bytes",
)


_NOT_HTTP = (
    "not a valid HTTP/1.1 request: a malformed request line or header, a Content-Length that"
    f" is not a number, or more than {MAX_HEADERS} header lines or {MAX_HEADER_BYTES} bytes of"
    " headers; the connection is closed"
)


def _error_body(code: str, message: str) -> bytes:
    return json.dumps({"error": code, "message": message}).encode()


async def _unavailable(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    """The app for a request past LIMIT_CONCURRENCY: `503 unavailable`, closing."""
    body = _error_body("unavailable", "too many requests in flight; retry shortly")
    await send({
        "type": "http.response.start",
        "status": 503,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"access-control-allow-origin", b"*"),
            (b"retry-after", b"1"),
            (b"connection", b"close"),
        ],
    })
    await send({"type": "http.response.body", "body": body, "more_body": False})


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

    def on_headers_complete(self) -> None:
        # uvicorn's own check (with limit_concurrency set) would answer in plain text: the
        # same rule, with the JSON answer as the app for this one request
        busy = (len(self.connections) >= LIMIT_CONCURRENCY
                or len(self.tasks) >= LIMIT_CONCURRENCY)
        app = self.app
        if busy:
            self.app = _unavailable
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refused (and to the header bounds), in
        JSON; the connection is closed, as uvicorn does (the stream cannot be trusted)."""
        body = _error_body("http_error", _NOT_HTTP)
        head = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            head.extend([name, b": ", value, b"\r\n"])
        head.extend([
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"access-control-allow-origin: *\r\n",
            b"connection: close\r\n\r\n",
            body,
        ])
        self.transport.write(b"".join(head))
        self.transport.close()

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
    return {"http": BoundedHttpProtocol}
