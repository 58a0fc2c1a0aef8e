"""Fixtures that start real relay and service processes for a test and stop them after it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import Engine

FAST_RECONNECT = "[bridge]\nreconnect_min_seconds = 0.2\nreconnect_max_seconds = 1.0\n"
SHORT_LEASES = "lease_seconds = 3\n"
"""On PostgreSQL a worker restarted after a SIGKILL gets the dead worker's key shards once their
leases lapse: 3 s instead of the default 15 s keeps restart stories short."""


@pytest.fixture(scope="module")
def module_relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    """One `nostr-relay` shared by the tests of a module that only publish to it and read from
    it under fresh keys (no test restarts, stops or gates it): a relay start per module instead
    of per test. Stories about a relay's restart, death or NIP-42 gate start their own."""
    with RelayProcess(tmp_path_factory.mktemp("relay")) as running:
        yield running


@pytest.fixture
def start_relay(tmp_path: Path) -> Iterator[Callable[..., RelayProcess]]:
    started: list[RelayProcess] = []

    def start(name: str, **options: Any) -> RelayProcess:
        relay = RelayProcess(tmp_path / name, **options).start()
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop()


@pytest.fixture
def start_service(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., ServiceProcess]]:
    """Starts services, each on a store of its own: on SQLite, or on the test's engine when the
    test takes `engine` too (then it runs on both). A process-level story is about the process
    (relays, signals, the wire); the store's behaviour is checked on both engines in process
    (testkit.in_process), so only stories about persistence or restarts take `engine`."""
    engine = (
        request.getfixturevalue("engine")
        if "engine" in request.fixturenames
        else Engine("sqlite", None)
    )
    started: list[ServiceProcess] = []

    def start(relays: list[str], extra_toml: str = FAST_RECONNECT) -> ServiceProcess:
        if engine.postgres:
            extra_toml = (
                extra_toml.replace("[bridge]\n", "[bridge]\n" + SHORT_LEASES, 1)
                if "[bridge]\n" in extra_toml
                else "[bridge]\n" + SHORT_LEASES + extra_toml
            )
        service = ServiceProcess(
            tmp_path / f"service{len(started)}", relays, extra_toml, database=engine.database()
        ).start()
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()


@pytest.fixture
def workers() -> Iterator[list[ServiceProcess]]:
    """Service processes a test starts itself (workers of one instance), all stopped after it."""
    started: list[ServiceProcess] = []
    yield started
    for service in started:
        service.stop()


def worker_health(service: ServiceProcess) -> dict[str, Any]:
    """A worker's operator /health, or {} while it is down or restarting (tests poll it)."""
    try:
        return dict(httpx.get(service.admin_url + "/health", timeout=scaled(REQUEST_SECONDS)).json())
    except (httpx.HTTPError, ValueError):
        return {}
