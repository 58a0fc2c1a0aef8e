"""Runs the API and the bridge in one uvicorn process until SIGINT/SIGTERM.

uvicorn re-raises a captured signal after its graceful shutdown, which would turn a clean
stop into death by signal; `_Server` keeps the graceful part and exits normally.

With `server.admin_listen` a second uvicorn listener in the same process and event loop serves
the operator surface (`/metrics`, `/health` with per-relay detail); the public listener then
answers `/metrics` with 404 and `/health` with the status alone. The public server owns the
signals and the service's lifespan, and stops the admin listener with it. Both listening
sockets are bound before the event loop starts: a port another process holds ends the start
at once with exit code 1, before the service opens its store or dials a relay.

Every file the process creates (database, WAL/SHM, observation log, keys) is private to the
service user: the umask is 077 before anything is opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import Iterator
from types import FrameType
from typing import Literal

import uvicorn
from uvicorn._compat import asyncio_run

from sigil_push.config import Config
from sigil_push.http.api import create_admin_app, create_app
from sigil_push.http.protocol import server_options
from sigil_push.http.ratelimit import trusted_networks
from sigil_push.service import Service
from sigil_push.telemetry.tracebacks import WithholdMessages

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_SECONDS = 5
GC_YOUNG_THRESHOLD = 50_000


def tune_gc() -> None:
    """Collect the young generation less often.

    The ingest path allocates many short-lived objects per event (parsed frames, events,
    arrivals); with the default threshold of 700 the collector ran thousands of times a second
    and cost about a tenth of a core at full ingest (bench/ingest.py). The objects die young
    either way, so memory use barely changes.
    """
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


class _AdminServer(uvicorn.Server):
    """The admin listener: stopped by the public server, never by signals of its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _Server(uvicorn.Server):
    admin: _AdminServer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if self.admin is not None:
            self.admin.should_exit = True


_UVICORN_TRACEBACKS = WithholdMessages()
"""Starlette re-raises what the app's 500 handler answered (api.py logs it, message withheld)
so that the server logs it too: uvicorn's `Exception in ASGI application` traceback."""


def _uvicorn_config(app: object, listen: str, lifespan: Literal["on", "off"]) -> uvicorn.Config:
    logging.getLogger("uvicorn.error").addFilter(_UVICORN_TRACEBACKS)
    host, _, port = listen.rpartition(":")
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host.strip("[]"),
        port=int(port),
        lifespan=lifespan,
        access_log=False,
        log_config=None,
        server_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        **server_options(),
    )


def _bind(listener: uvicorn.Config) -> socket.socket:
    """The listener's socket, bound (`OSError` when the address is taken or not ours).

    Bound here rather than by uvicorn inside the running loop: there the admin listener's
    failed bind ended its task with `SystemExit` while the public server was still starting
    the service, and the process sometimes stayed up without its admin listener."""
    family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
    bound = socket.socket(family, socket.SOCK_STREAM)
    try:
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound.bind((listener.host, listener.port))
    except OSError:
        bound.close()
        raise
    return bound


async def _serve(
    server: _Server, admin: _AdminServer | None, sockets: list[socket.socket]
) -> None:
    public_socket, *admin_socket = sockets
    if admin is None:
        await server.serve(sockets=[public_socket])
        return
    admin_task = asyncio.create_task(admin.serve(sockets=admin_socket), name="admin listener")
    try:
        await server.serve(sockets=[public_socket])
    finally:
        admin.should_exit = True
        await admin_task


def warn_if_trusting_everyone(trusted_proxies: tuple[str, ...]) -> bool:
    """A trusted proxy range covering every address (`0.0.0.0/0`, `::/0`) lets any client
    choose the address it is rate-limited under with X-Forwarded-For; said at start-up."""
    if not any(network.prefixlen == 0 for network in trusted_networks(trusted_proxies)):
        return False
    log.warning(
        "server.trusted_proxies covers every address: any client can choose the address"
        " it is rate-limited under with X-Forwarded-For"
    )
    return True


def run_server(config: Config) -> int:
    os.umask(0o077)
    tune_gc()
    service = Service(config)
    server = _Server(_uvicorn_config(create_app(service), config.server.listen, "on"))
    if config.server.admin_listen:
        server.admin = _AdminServer(
            _uvicorn_config(create_admin_app(service), config.server.admin_listen, "off")
        )
    warn_if_trusting_everyone(config.server.trusted_proxies)
    listeners = [server.config] + ([server.admin.config] if server.admin is not None else [])
    sockets: list[socket.socket] = []
    try:
        for listener in listeners:
            sockets.append(_bind(listener))
    except OSError as exc:
        for bound in sockets:
            bound.close()
        log.error("sigil-push cannot listen on %s:%d (%s)", listener.host, listener.port,
                  exc.strerror or type(exc).__name__)
        return 1
    log.info("sigil-push listening on %s (public URL %s)", config.server.listen, config.server.public_url)
    if config.server.admin_listen:
        log.info("admin listener (metrics, relay detail) on %s", config.server.admin_listen)
    try:
        asyncio_run(
            _serve(server, server.admin, sockets), loop_factory=server.config.get_loop_factory()
        )
    finally:
        for bound in sockets:
            bound.close()
    if not server.started:
        log.error("sigil-push did not start")
        return 1
    log.info("sigil-push stopped")
    return 0
