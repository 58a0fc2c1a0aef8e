"""Flood fairness in the bridge: a relay that floods fills only its own share of the commit
queue and pauses only its own reader; a flood of DMs to one key (e.g. to oneself) is capped by
that key's quota, dropped and counted, and cannot fill the queue for everyone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client import REGISTRY

from sigil_push.bridge.ingest import RECIPIENT_BURST
from sigil_push.bridge.pending import RELAY_QUEUE_CAP
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.relays.labels import series_label
from testkit.deadlines import scaled
from testkit.fakes.harness import eventually
from testkit.in_process import in_process_bridge
from testkit.stores import Engine

FLOODER = "wss://flood.example"
QUIET = "wss://quiet.example"


def _dropped(relay: str, reason: str) -> float:
    return REGISTRY.get_sample_value(
        "sigil_push_bridge_events_dropped_total",
        {"relay": series_label(relay), "reason": reason},
    ) or 0.0


async def test_one_relays_flood_pauses_only_that_relay_and_one_keys_flood_is_capped(
    tmp_path: Path, engine: Engine
) -> None:
    async with in_process_bridge(tmp_path, engine.database("push.db")) as parts:
        db, devices, bridge = parts.db, parts.devices, parts.bridge
        mallory, victim = SecretKey.generate(), SecretKey.generate()
        for key, token in ((mallory, "fcm-mallory"), (victim, "fcm-victim")):
            await devices.register(key.public_key_hex, "android", token, "opaque", (), None, 0)
        await eventually(
            lambda: {mallory.public_key_hex, victim.public_key_hex} <= bridge._registry.keys,
            what="both keys watched",
        )
        me = mallory.public_key_hex
        now_ms = int(time.time() * 1000)
        # a flood the committer has not seen yet: nothing yields while it arrives
        for i in range(RELAY_QUEUE_CAP):
            event = sign_event(mallory, 4, f"old {i}", [["p", me]])
            bridge.port.ingest.user_event(FLOODER, me, event.to_json(), now_ms, True)
        assert bridge.port.flow.congested(FLOODER)
        assert not bridge.port.flow.congested(QUIET), "another relay's reader must not wait"

        before = _dropped(FLOODER, "recipient_quota")
        flood = [sign_event(mallory, 4, f"to myself {i}", [["p", me]]) for i in range(300)]
        for event in flood:
            bridge.port.ingest.user_event(FLOODER, me, event.to_json(), now_ms, False)
        dropped = _dropped(FLOODER, "recipient_quota") - before
        assert 300 - RECIPIENT_BURST - 5 <= dropped <= 300 - RECIPIENT_BURST

        wanted = sign_event(SecretKey.generate(), 4, "hi", [["p", victim.public_key_hex]])
        bridge.port.ingest.user_event(QUIET, victim.public_key_hex, wanted.to_json(), now_ms, False)
        await asyncio.wait_for(bridge.port.flow.drained(FLOODER), timeout=scaled(60))

        async def victim_queued() -> bool:
            rows = await db.execute_fetchall(
                "SELECT 1 FROM outbox WHERE event_id = ?", (wanted.id,)
            )
            return bool(rows)

        await eventually(victim_queued, timeout=60.0, what="the victim's wakeup in the outbox")
