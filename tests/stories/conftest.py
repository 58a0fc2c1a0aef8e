"""Fixtures the end-to-end stories share."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.in_process import InProcessService, in_process_service
from testkit.service import ServiceProcess


@pytest.fixture
async def instance(
    tmp_path: Path, apns_relay_config: dict[str, Any]
) -> AsyncIterator[InProcessService]:
    """A whole `Service` in the test's event loop (testkit.in_process), sending to the fake
    APNs server, reading the module's relay, its observation log in `tmp_path`: the phones'
    service (testkit.phones)."""
    apns_relay_config["server"]["observations"] = "observations"
    async with in_process_service(tmp_path, apns_relay_config) as running:
        yield running


@pytest.fixture
def http_of() -> Iterator[Callable[[ServiceProcess], httpx.Client]]:
    """HTTP clients to any of the test's services (`http_of(service)`), closed at its end."""
    clients: list[httpx.Client] = []

    def make(service: ServiceProcess) -> httpx.Client:
        client = httpx.Client(base_url=service.url, timeout=scaled(REQUEST_SECONDS))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
