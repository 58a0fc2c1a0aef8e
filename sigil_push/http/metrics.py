"""Prometheus metrics for the REST API, recorded by a pure ASGI middleware.

Routes are labelled by their template, never by raw paths, and methods outside HTTP's usual
few as `other` (a client may send any token as its method), so scanners cannot blow up the
number of series.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

KNOWN_ROUTES = (
    "/register", "/unregister", "/registrations", "/preferences", "/presence", "/health",
    "/metrics", "/info", "/subscriptions", "/subscriptions/",
)
SUBSCRIPTION_ROUTE = "/subscriptions/{id}"
"""The label of every `/subscriptions/<id>` path (ids are the callers')."""
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

REQUESTS = Counter(
    "sigil_push_http_requests_total", "API requests by route, method and status",
    ["route", "method", "status"],
)
LATENCY = Histogram(
    "sigil_push_http_request_duration_seconds", "API request latency by route", ["route"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
for _route in (*KNOWN_ROUTES, SUBSCRIPTION_ROUTE):
    LATENCY.labels(_route)


def route_label(path: str) -> str:
    if path in KNOWN_ROUTES:
        return path
    return SUBSCRIPTION_ROUTE if path.startswith("/subscriptions/") else "other"


class MetricsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])
        method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
        status = 500
        started = time.perf_counter()

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            LATENCY.labels(route).observe(time.perf_counter() - started)
            REQUESTS.labels(route, method, str(status)).inc()
