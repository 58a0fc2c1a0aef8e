"""Runs the API and the bridge in one uvicorn process until SIGINT/SIGTERM.

uvicorn re-raises a captured signal after its graceful shutdown, which would turn a clean
stop into death by signal; `_Server` keeps the graceful part and exits normally.
"""

from __future__ import annotations

import gc
import logging
import signal
from types import FrameType

import uvicorn

from sigil_push.api import create_app
from sigil_push.config import Config
from sigil_push.service import Service

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


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def run_server(config: Config) -> int:
    tune_gc()
    service = Service(config)
    server = _Server(
        uvicorn.Config(
            create_app(service),
            host=config.server.host,
            port=config.server.port,
            lifespan="on",
            access_log=False,
            log_config=None,
            server_header=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        )
    )
    log.info("sigil-push listening on %s (public URL %s)", config.server.listen, config.server.public_url)
    server.run()
    if not server.started:
        log.error("sigil-push did not start")
        return 1
    log.info("sigil-push stopped")
    return 0
