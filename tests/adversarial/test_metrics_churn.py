"""One npub re-registering again and again with fresh relay URLs once grew /metrics without
bound (55 KB to 2.9 MB): per-relay series were created for every URL ever opened and never
removed. Relays that come only from users now share the label `relay="user"` (see
test_user_relay_labels), so no user URL is ever a label; a configured relay's series go when the
bridge stops using it, and a configured URL whose path carries a key (`/npub1…`, 64 hex) never
shows that key in a label. In process, on a SQLite file; the relays are closed loopback ports."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip19 import encode_npub
from sigil_push.telemetry.redaction import relay_label
from testkit.in_process import in_process_bridge
from tests.adversarial.hostile import eventually

ROUNDS = 6
PER_ROUND = 10


def _relay_labels() -> set[str]:
    labels: set[str] = set()
    for family in REGISTRY.collect():
        for sample in family.samples:
            relay = sample.labels.get("relay")
            if relay is not None and relay.startswith("ws://127.0.0.1:9/"):
                labels.add(relay)
    return labels


async def test_relay_series_follow_the_relays_in_use(tmp_path: Path) -> None:
    user, stranger = SecretKey.generate(), SecretKey.generate()
    npub = encode_npub(stranger.public_key_hex)
    configured = f"ws://127.0.0.1:9/{npub}"
    async with in_process_bridge(
        tmp_path, "push.db", relays=[{"url": configured}],
        server={"allow_insecure_relays": True},
    ) as parts:
        for round_number in range(ROUNDS):
            relays = [f"ws://127.0.0.1:9/r{round_number}-{i}" for i in range(PER_ROUND - 2)]
            relays += [f"ws://127.0.0.1:9/{npub}/{round_number}",
                       f"ws://127.0.0.1:9/inbox/{stranger.public_key_hex}/{round_number}"]
            await parts.devices.register(
                user.public_key_hex, "android", "fcm-churn", "opaque", relays, None, 0
            )
            await eventually(
                # /health names relays by label: two of these URLs carry a key
                lambda relays=relays: set(map(relay_label, relays)) <= set(parts.bridge.health()),
                f"round {round_number}'s relays opened", timeout=60.0,
            )
            assert len(_relay_labels()) == 1, "user relays have no URL label"
        labels = _relay_labels()
        assert len(labels) == 1, "the configured relay keeps its URL label"
        text = " ".join(labels)
        assert npub not in text and stranger.public_key_hex not in text
        assert "<key-" in text
