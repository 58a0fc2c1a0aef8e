"""Canary probes end to end: a real `sigil-push serve` process probes real `nostr-relay`
processes, one of them gating writes behind NIP-42 AUTH, one behind a layer that accepts gift
wraps and never serves them, and one that is down. Every wait polls with a generous deadline.
The probing story is about the wire and runs on SQLite; the story of the canary key surviving a
restart is about the store and runs on each engine: on PostgreSQL the one worker probes as
holder of shard 0's lease (several workers probing: tests/stories/test_pg_canary.py).
"""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sigil_push.nostr.keys import SecretKey
from testkit.bridge_harness import (
    assert_private,
    eventually,
    metric,
    new_token,
    register,
    relay_live,
    wakeups,
)
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.dropping_relay import GiftWrapDroppingRelay
from testkit.nostr_client import gift_wrap, hex_of, npub_of, publish, user
from testkit.relay import RelayProcess, free_port
from testkit.service import ServiceProcess
from testkit.stores import Engine

SQLITE = Engine("sqlite", None)

pytestmark = pytest.mark.slow  # every story here starts its own processes

INTERVAL_SECONDS = 2
# nostr-relay holds its answer to a refused write for 2 s (throttling): the gated relay's probes
# need an interval with room for that and the AUTH round after it
GATED_INTERVAL_SECONDS = 5
DEADLINE_SECONDS = 60.0
CANARY_FIELDS = {"type", "ts", "relay", "event_id", "published", "ok_message", "received_ms"}


def metrics_text(service: ServiceProcess) -> str:
    return httpx.get(service.admin_url + "/metrics", timeout=scaled(REQUEST_SECONDS)).text


def sample(scrape: str, name: str, relay: str) -> float:
    """Sum of `name`'s samples for `relay` in one /metrics text."""
    return sum(
        s.value
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
        if s.name == name and s.labels.get("relay") == relay
    )


def canaries(service: ServiceProcess, relay: str) -> list[dict[str, Any]]:
    return [
        r for r in service.observation_records() if r["type"] == "canary" and r["relay"] == relay
    ]


async def test_probes_are_published_received_and_failures_are_told_apart(
    start_relay: Callable[..., RelayProcess], tmp_path: Path
) -> None:
    """Each configured relay gets probes. A healthy relay and one that wants NIP-42 AUTH for
    writes (answered with the bridge key, then the probe is sent again) deliver them back
    through the bridge's subscription; a layer that says OK to gift wraps but swallows them
    gives `received_ms: null` and `not_received`; a relay that is down gives `published:
    false` and `connect`. No probe wakes anyone, leaves a `seen` record or counts as an
    unknown recipient, while a real DM on the same relays is still pushed once."""
    bridge_key = SecretKey.generate()
    healthy = start_relay("healthy")
    gated = start_relay("gated", auth_actions={"save": "w"})
    gated.grant_role(bridge_key.public_key_hex, "aw")
    behind = start_relay("behind")
    down = f"ws://127.0.0.1:{free_port()}"
    async with GiftWrapDroppingRelay(behind.url) as dropping:
        configured = [healthy.url, gated.url, dropping.url, down]
        service = ServiceProcess(
            tmp_path / "service",
            configured,
            "[bridge]\nreconnect_min_seconds = 0.2\nreconnect_max_seconds = 1.0\n"
            f"[canary]\ninterval_seconds = {GATED_INTERVAL_SECONDS}\n",
            database=SQLITE.database(),
        )
        text = service.config_path.read_text()
        service.config_path.write_text(
            text.replace("[server]\n", f'[server]\nsecret_key = "{bridge_key.secret_hex}"\n', 1)
        )
        with service:
            alice, bob, token = user(), user(), new_token()
            register(service, alice, token)
            await eventually(
                lambda: relay_live(service, healthy.url, 2), "alice and the canary subscribed"
            )

            def settled() -> bool:
                return (
                    any(r["received_ms"] is not None for r in canaries(service, healthy.url))
                    and any(r["received_ms"] is not None for r in canaries(service, gated.url))
                    and any(r["published"] for r in canaries(service, dropping.url))
                    and bool(canaries(service, down))
                )

            await eventually(settled, "a probe settled on every relay", DEADLINE_SECONDS)
            wrap = gift_wrap(bob, alice, "a real DM beside the probes")
            await publish(healthy.url, wrap)
            await eventually(lambda: wakeups(service)[wrap["id"]] == 1, "the real DM pushed")

            records = [r for r in service.observation_records() if r["type"] == "canary"]
            for record in records:
                assert set(record) == CANARY_FIELDS
            for relay in (healthy.url, gated.url):
                delivered = [r for r in canaries(service, relay) if r["received_ms"] is not None]
                assert all(r["published"] and r["received_ms"] >= 0 for r in delivered)
                # one scrape: probes keep settling between two
                scrape = metrics_text(service)
                delivered_count = sample(scrape, "sigil_push_canary_delivery_seconds_count", relay)
                assert delivered_count >= 1
                assert sample(scrape, "sigil_push_canary_probes_total", relay) == (
                    delivered_count + sample(scrape, "sigil_push_canary_failures_total", relay)
                )
            swallowed = canaries(service, dropping.url)
            assert all(r["received_ms"] is None for r in swallowed)
            assert {r["event_id"] for r in swallowed if r["published"]} <= set(dropping.swallowed)
            assert (
                metric(
                    service, "sigil_push_canary_failures_total",
                    relay=dropping.url, reason="not_received",
                )
                >= 1
            )
            assert all(
                not r["published"] and r["received_ms"] is None for r in canaries(service, down)
            )
            assert (
                metric(service, "sigil_push_canary_failures_total", relay=down, reason="connect")
                >= 1
            )
            assert metric(service, "sigil_push_canary_failures_total", relay=healthy.url) == 0

            probe_ids = {r["event_id"] for r in records}
            seen_ids = {
                r["event_id"] for r in service.observation_records() if r["type"] == "seen"
            }
            assert not probe_ids & seen_ids, "a probe was recorded as a delivered DM"
            assert not probe_ids & set(wakeups(service)), "a probe woke a device"
            assert (
                metric(
                    service, "sigil_push_bridge_events_dropped_total", reason="unknown_recipient"
                )
                == 0
            )
            assert metric(service, "sigil_push_bridge_events_pushed_total") == 1
            assert_private(service, [hex_of(alice), npub_of(alice), hex_of(bob), token])

    key_file = service.folder / "canary.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert len(key_file.read_text().strip()) == 64


async def test_the_canary_key_survives_a_restart_and_probes_a_listed_relay_only(
    start_relay: Callable[..., RelayProcess], tmp_path: Path, engine: Engine
) -> None:
    """`canary.relays` narrows the probes to the relays named; the key generated on the first
    start is the one used after a restart (relays keep seeing the same recipient)."""
    probed, other = start_relay("probed"), start_relay("other")
    service = ServiceProcess(
        tmp_path / "service",
        [probed.url, other.url],
        f'[canary]\ninterval_seconds = {INTERVAL_SECONDS}\nrelays = ["{probed.url}"]\n',
        database=engine.database(),
    )
    with service:
        await eventually(
            lambda: any(r["received_ms"] is not None for r in canaries(service, probed.url)),
            "a probe delivered on the listed relay",
            DEADLINE_SECONDS,
        )
    first_key = (service.folder / "canary.key").read_text()
    with service:
        before = len(canaries(service, probed.url))
        await eventually(
            lambda: any(
                r["received_ms"] is not None for r in canaries(service, probed.url)[before:]
            ),
            "a probe delivered after the restart",
            DEADLINE_SECONDS,
        )
    assert (service.folder / "canary.key").read_text() == first_key
    assert canaries(service, other.url) == []
