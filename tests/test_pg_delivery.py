"""The delivery loop's promises (tests/test_push_delivery.py) again, with the outbox and the
devices on a real PostgreSQL: coalescing, per-device limits, payload modes, stale drops,
retries, resume after a crash with the same collapse id, dry-run, privacy. The stories are
the same functions; only the store under the harness changes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sigil_push.observations import ObservationLog
from tests.fakes.fake_apns import FakeApns
from tests.fakes.fake_fcm import FakeFcm
from tests.fakes.fake_unifiedpush import FakeUnifiedPush
from tests.fakes.harness import Credentials, Harness, document, provider_tables, reset_fakes
from tests.support.postgres import PostgresServer
from tests.support.stores import fresh_postgres_database, open_test_store
from tests.test_push_delivery import *


class PostgresHarness(Harness):
    """The delivery harness with its store on PostgreSQL."""

    def __init__(self, folder: Path, document: dict[str, Any], url: str) -> None:
        super().__init__(folder, document)
        self.url = url

    async def open(self) -> None:
        self.store = await open_test_store(self.url)
        self.db = self.store.db  # type: ignore[assignment]
        self.devices = self.store.devices  # type: ignore[assignment]
        self.outbox = self.store.outbox  # type: ignore[assignment]
        self.observations = ObservationLog(self.folder / "observations")
        await self.observations.start()

    async def close(self) -> None:
        await self.stop_delivery()
        await self.observations.stop()
        await self.store.close()


@pytest.fixture
async def make_harness(
    tmp_path: Path,
    credentials: Credentials,
    fake_apns: FakeApns,
    fake_fcm_server: tuple[FakeFcm, Path],
    fake_up: FakeUnifiedPush,
    postgres_server: PostgresServer,
) -> AsyncIterator[Callable[..., Any]]:
    """`make_harness` of tests.fakes.harness, each harness on a fresh PostgreSQL database."""
    harnesses: list[PostgresHarness] = []
    reset_fakes(fake_apns, fake_fcm_server[0], fake_up)

    async def make(
        push: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
        providers: dict[str, Any] | None = None,
        start: bool = True,
    ) -> Harness:
        tables = (
            provider_tables(credentials, fake_apns, fake_fcm_server) if providers is None
            else providers
        )
        folder = tmp_path / f"service-{len(harnesses)}"
        folder.mkdir()
        url = await fresh_postgres_database(postgres_server)
        harness = PostgresHarness(folder, document(tables, push, limits), url)
        await harness.open()
        harnesses.append(harness)
        if start:
            await harness.start()
        return harness

    yield make
    for harness in harnesses:
        await harness.close()
