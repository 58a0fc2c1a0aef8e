"""Fixtures the end-to-end stories share."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from testkit.in_process import InProcessService, in_process_service


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
