"""`sigil-push serve` on PostgreSQL: real service processes, a real PostgreSQL server, a real
`nostr-relay` and the fake APNs. The whole service runs on the database URL (no SQLite file
appears), a DM is pushed once, and a NIP-98 auth event used on one worker is refused by
another worker of the same instance (same database, same public URL behind a balancer)."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.bridge_harness import assert_private, eventually, eventually_async, relay_live
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.harness import Credentials, provider_tables, toml_tables
from testkit.nip98 import SdkUser
from testkit.nostr_client import kind4_dm, publish, user
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import on_database

pytestmark = pytest.mark.slow  # every story here starts its own processes


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    yield started
    for service in started:
        service.stop()


def _register(service: ServiceProcess, person: SdkUser, token: str, url: str | None = None) -> tuple[httpx.Response, str, bytes]:
    body = json.dumps({"npub": person.npub, "platform": "ios", "device_token": token}).encode()
    header = person.header((url or service.url) + "/register", "POST", body)
    response = httpx.post(
        service.url + "/register", content=body, timeout=scaled(REQUEST_SECONDS),
        headers={"content-type": "application/json", "authorization": header},
    )
    return response, header, body


async def _count(url: str, sql: str) -> int:
    connection = await asyncpg.connect(url)
    try:
        return int(await connection.fetchval(sql))
    finally:
        await connection.close()


async def test_serve_on_postgres_pushes_a_relayed_dm_once(
    tmp_path: Path,
    postgres_url: str,
    start_relay: Callable[..., RelayProcess],
    credentials: Credentials,
    fake_apns: FakeApns,
    fake_fcm_server: object,
    workers: list[ServiceProcess],
) -> None:
    relay = start_relay("relay")
    tables = provider_tables(credentials, fake_apns, fake_fcm_server)  # type: ignore[arg-type]
    service = ServiceProcess(
        tmp_path / "worker", [relay.url], FAST_RECONNECT + toml_tables({"apns": tables["apns"]})
    )
    workers.append(on_database(service, postgres_url).start())
    recipient, token = SdkUser(), secrets.token_hex(32)
    response, _, _ = _register(service, recipient, token)
    assert response.status_code == 201, response.text
    assert await _count(postgres_url, "SELECT count(*) FROM devices") == 1
    await eventually(lambda: relay_live(service, relay.url, 1), "the relay subscribed for the key")

    sender = user()
    dm = kind4_dm(sender, recipient.keys, "the launch code is 0000")
    await publish(relay.url, dm)

    def ours() -> list[object]:
        return [r for r in fake_apns.requests if r.token == token]

    await eventually(lambda: len(ours()) >= 1, "the DM was pushed to APNs")
    await eventually_async(lambda: _empty(postgres_url), "the outbox row was settled")
    await publish(relay.url, dm)  # the same event again: already handled, never pushed twice
    assert await _count(
        postgres_url, f"SELECT count(*) FROM seen_events WHERE event_id = decode('{dm['id']}', 'hex')"
    ) == 1
    assert len(ours()) == 1
    request = ours()[0]
    assert "launch code" not in json.dumps(request.body)  # type: ignore[attr-defined]
    assert recipient.hex not in json.dumps(request.body)  # type: ignore[attr-defined]
    assert not list(service.folder.glob("*.db*")), "no SQLite file next to the config"
    async with httpx.AsyncClient(base_url=service.admin_url, timeout=scaled(REQUEST_SECONDS)) as admin:
        worker = (await admin.get("/health")).json()["worker"]
        text = (await admin.get("/metrics")).text
    unlabelled = {
        sample.name for family in text_string_to_metric_families(text)
        for sample in family.samples if sample.labels.get("worker") != worker
    }
    assert unlabelled == set(), "every series of a worker names it"
    assert 'sigil_push_pushes_total{outcome="accepted",provider="apns",worker=' in text
    assert_private(service, [recipient.hex, recipient.npub, token, str(sender.public_key().to_hex())])


async def _empty(url: str) -> bool:
    return await _count(url, "SELECT count(*) FROM outbox") == 0


def test_a_nip98_auth_event_is_spent_across_workers(
    tmp_path: Path, postgres_url: str, workers: list[ServiceProcess]
) -> None:
    """An auth event spent on one worker is known to the other: the very same request again
    is an idempotent retry there (200, one row of nip98_used, nothing added)."""
    key_file = tmp_path / "bridge.key"
    first = on_database(ServiceProcess(tmp_path / "first"), postgres_url, key_file=key_file)
    workers.append(first.start())
    second = on_database(
        ServiceProcess(tmp_path / "second"), postgres_url, public_url=first.url, key_file=key_file
    )
    workers.append(second.start())
    person = SdkUser()
    response, header, body = _register(first, person, secrets.token_hex(32))
    assert response.status_code == 201, response.text

    retried = httpx.post(
        second.url + "/register", content=body, timeout=scaled(REQUEST_SECONDS),
        headers={"content-type": "application/json", "authorization": header},
    )
    assert retried.status_code == 200, retried.text
    fresh, _, _ = _register(second, person, secrets.token_hex(32), url=first.url)
    assert fresh.status_code == 201, fresh.text
    assert asyncio.run(_count(postgres_url, "SELECT count(*) FROM devices")) == 2
    assert asyncio.run(_count(postgres_url, "SELECT count(*) FROM nip98_used")) == 2


def test_a_worker_with_another_bridge_key_is_refused_with_exit_2(
    tmp_path: Path, postgres_url: str, workers: list[ServiceProcess]
) -> None:
    """Workers of one instance share the bridge key (relays see one client; delegated-auth
    sessions are sealed under it): one with its own key stops at once, naming the key file,
    and leaves the instance's sessions alone."""
    first = on_database(ServiceProcess(tmp_path / "first"), postgres_url)
    workers.append(first.start())
    stranger = on_database(ServiceProcess(tmp_path / "stranger"), postgres_url)
    stranger.start(wait=False)
    assert stranger.wait_exit() == 2
    lines = [line for line in stranger.log().splitlines() if line.startswith("sigil-push:")]
    assert len(lines) == 1 and "server.secret_key_file" in lines[0]
    assert httpx.get(first.url + "/health", timeout=scaled(REQUEST_SECONDS)).status_code == 200
