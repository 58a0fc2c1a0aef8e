"""CORS on every API route: browser apps (Iris) call the API from their own origin.

Any origin may call: every request that changes or reads a user's data carries a NIP-98
signature the page itself must make, and nothing here rides on cookies, so allowing `*` gives
a foreign page nothing it could not do with curl. A preflight (`OPTIONS`) is answered here with
204, before routing, rate limits or authentication (a browser sends it without credentials and
caches the answer for a day); every other response gains `Access-Control-Allow-Origin: *`,
errors included, so the page can read the JSON error rather than an opaque network failure.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ALLOW_ORIGIN = (b"access-control-allow-origin", b"*")
PREFLIGHT_HEADERS = [
    ALLOW_ORIGIN,
    (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
    (b"access-control-allow-headers", b"authorization, content-type"),
    (b"access-control-max-age", b"86400"),
    (b"access-control-expose-headers", b"retry-after"),
]


class CorsMiddleware:
    """Pure ASGI (no response buffering): preflights answered, the header added to the rest."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 204, "headers": PREFLIGHT_HEADERS})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_origin(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), ALLOW_ORIGIN]
            await send(message)

        await self.app(scope, receive, send_with_origin)
