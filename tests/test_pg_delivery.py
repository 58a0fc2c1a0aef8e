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
from tests.fakes.harness import Credentials, Harness, harness_factory
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

    async def build(folder: Path, document: dict[str, Any]) -> Harness:
        return PostgresHarness(folder, document, await fresh_postgres_database(postgres_server))

    async with harness_factory(
        tmp_path, credentials, fake_apns, fake_fcm_server, fake_up, build
    ) as make:
        yield make
