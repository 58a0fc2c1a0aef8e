"""Every in-memory structure that grows with use reports its size
(`sigil_push_memory_entries{structure}`), read at scrape time: growth under steady load shows
on a dashboard before it shows as RSS (issue 22: RSS climbed ~2 MB a minute with no gauge to say
where). In process, a real bridge on a SQLite file fed one verified DM."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client import REGISTRY

from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from testkit.in_process import in_process_bridge
from tests.adversarial.hostile import eventually

STRUCTURES = (
    "recently_verified", "seen_cache", "seen_relay_names", "recipient_buckets",
    "relay_counters", "relay_baselines", "relay_cursors", "relay_plan_keys", "relay_lists",
    "registration_relays",
)


def entries(structure: str) -> float | None:
    return REGISTRY.get_sample_value("sigil_push_memory_entries", {"structure": structure})


async def test_growable_structures_report_their_size(tmp_path: Path) -> None:
    recipient = SecretKey.generate()
    async with in_process_bridge(tmp_path, "push.db") as parts:
        await parts.devices.register(
            recipient.public_key_hex, "android", "fcm-gauges", "opaque", (), None, 0
        )
        await eventually(lambda: recipient.public_key_hex in parts.bridge._registry.keys,
                         "the key watched")
        before = entries("recently_verified") or 0.0
        dm = sign_event(SecretKey.generate(), 4, "hi", [["p", recipient.public_key_hex]])
        parts.bridge.port.ingest.user_event("wss://inbox.example", recipient.public_key_hex,
                                   dm.to_json(), int(time.time() * 1000), False)
        assert {s: entries(s) for s in STRUCTURES if entries(s) is None} == {}
        assert entries("recently_verified") == before + 1
        assert (entries("recipient_buckets") or 0) >= 1
        await eventually(lambda: (entries("seen_cache") or 0) >= 1, "the DM remembered as seen")
