"""The outbox across SIGKILL: a real `sigil-push serve` process killed mid-delivery loses nothing.

The outbox is filled before start (as the bridge would have), APNs answers slowly so pushes are
in flight at the kill, then the service is restarted against a healthy APNs. Every wakeup must
arrive; the only ones allowed to arrive twice are those whose push was in flight or answered
but not yet deleted at the kill (bounded by the concurrency cap), and they are resent with the
same apns-collapse-id, so the phone replaces the first notification instead of showing two.

On each engine. On SQLite the restarted process releases the killed one's claims at start. On
PostgreSQL it is a new worker that cannot tell a killed worker from a live one until the
heartbeat is a minute old, so those claims come back when they lapse (two send timeouts plus
the stop grace): the test's short send timeout keeps that wait short.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import signal
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import now_ms
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.harness import (
    Credentials,
    provider_tables,
    toml_tables,
)
from testkit.service import ServiceProcess
from testkit.stores import Engine, fetch, opened

pytestmark = pytest.mark.slow  # every story here starts its own processes

EVENTS = 300
CONCURRENCY = 8


async def _fill(database: str, tokens: list[str]) -> list[str]:
    async with opened(database) as store:
        devices, outbox = store.devices, store.outbox
        recipient, sender = SecretKey.generate(), SecretKey.generate()
        registered = [
            (await devices.register(recipient.public_key_hex, "ios", t, "event_id", (), None, 0)).device
            for t in tokens
        ]
        ids = []
        for i in range(EVENTS):
            event = sign_event(sender, 4, f"message {i}", [["p", recipient.public_key_hex]])
            await outbox.enqueue(event, "wss://relay.example.com", now_ms(), [registered[i % len(registered)]])
            ids.append(event.id)
        return ids


def _outbox_depth(database: str) -> int:
    [(depth,)] = fetch(database, "SELECT COUNT(*) FROM outbox")
    return int(depth)


def _wait_for_metric(url: str, series: str) -> str:
    """The /metrics text once `series` has counted something (the pushes after the restart)."""
    deadline = time.monotonic() + scaled(30)
    while True:
        with urllib.request.urlopen(f"{url}/metrics", timeout=scaled(REQUEST_SECONDS)) as response:
            text = response.read().decode()
        # on PostgreSQL the series carries one more label, `worker`, after these
        line = next((line for line in text.splitlines()
                     if line.startswith((series, series[:-1] + ","))), "")
        if line and float(line.split()[-1]) > 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"{series} never counted")
        time.sleep(0.1)


def _wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_sigkill_mid_delivery_loses_no_wakeup(
    tmp_path: Path, credentials: Credentials, fake_apns: FakeApns, fake_fcm_server, engine: Engine
) -> None:
    tokens = [secrets.token_hex(32) for _ in range(4)]  # the fake APNs lives for the session
    tables = provider_tables(credentials, fake_apns, fake_fcm_server)
    extra = toml_tables({"apns": tables["apns"]}) + (
        f"[push]\nconcurrency_per_provider = {CONCURRENCY}\nretry_base_seconds = 0.1\n"
        "send_timeout_seconds = 2.0\n"
    )
    limits = ("requests_per_minute_per_ip = 0\nrequests_per_minute_per_npub = 0\n"
              "wakeups_per_minute_per_device = 0\ncoalesce_window_ms = 0")
    service = ServiceProcess(
        tmp_path / "service", extra_toml=extra, limits=limits, database=engine.database()
    )
    event_ids = asyncio.run(_fill(service.database, tokens))
    fake_apns.script.delay_seconds = 0.2

    def ours() -> list:
        return [r for r in fake_apns.requests if r.token in tokens]

    service.start()
    try:
        _wait(lambda: len(ours()) >= 40, 30, "pushes under way")
        assert service.stop(signal.SIGKILL) == -signal.SIGKILL
        before_kill = list(ours())
        assert _outbox_depth(service.database) > 0, "the kill came after the outbox drained"

        fake_apns.script.delay_seconds = 0.0
        service.start()
        _wait(lambda: _outbox_depth(service.database) == 0, 60, "the outbox to drain after restart")
        metrics = _wait_for_metric(service.admin_url, 'sigil_push_pushes_total{outcome="accepted",provider="apns"}')
    finally:
        fake_apns.script.delay_seconds = 0.0
        service.stop()

    received = Counter(r.body["event_id"] for r in ours())
    assert set(received) == set(event_ids), "every wakeup arrived"
    resent = [event_id for event_id, count in received.items() if count > 1]
    assert all(count <= 2 for count in received.values())
    assert set(resent) <= {r.body["event_id"] for r in before_kill}, "only in-doubt pushes repeat"
    # on the wire at the kill: at most CONCURRENCY; answered but not yet deleted: a few more
    assert len(resent) <= 2 * CONCURRENCY, "at most the in-flight window repeats"
    collapse_ids: dict[str, set[str]] = {}
    for request in ours():
        collapse_ids.setdefault(request.body["event_id"], set()).add(request.headers["apns-collapse-id"])
    assert all(len(ids) == 1 for ids in collapse_ids.values()), "a resend reuses the collapse id"
    if not engine.postgres:
        assert "in flight when the service last stopped" in service.log()
    assert re.search(
        r'^sigil_push_pushes_total\{outcome="unregistered",provider="apns"(,worker="[^"]+")?\} 0\.0$',
        metrics, re.MULTILINE,
    )
    assert "sigil_push_outbox_depth" in metrics and "sigil_push_push_latency_seconds_bucket" in metrics
