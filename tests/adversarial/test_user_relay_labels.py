"""User relays share bounded metric labels (issue 22): per-relay series followed the relays in
use, so /metrics still grew with every user relay the bridge watched (up to `max_relays`, 200 by
default, each with some forty series). Configured relays keep their URL label; relays that come
only from users share `relay="user"`, whose gauges are sums over them. Observation records still
name each relay by its (redacted) URL. In process, on a SQLite file; the user relays are closed
loopback ports, the configured relay a closed one too."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import REGISTRY, generate_latest

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip19 import encode_npub
from sigil_push.relays.labels import USER_RELAYS
from testkit.in_process import in_process_bridge
from tests.adversarial.hostile import eventually

CONFIGURED = "ws://127.0.0.1:9/configured"
ROUNDS = 4
NPUBS_PER_ROUND = 3
RELAYS_PER_NPUB = 10


def _series() -> tuple[set[str], int]:
    """The `relay` label values in /metrics and how many series carry a `relay` label (earlier
    tests in this process may have left their configured relays' series)."""
    labels: set[str] = set()
    count = 0
    for family in REGISTRY.collect():
        for sample in family.samples:
            relay = sample.labels.get("relay")
            if relay is not None:
                labels.add(relay)
                count += 1
    return labels, count


async def test_metrics_stay_bounded_as_users_name_more_relays(tmp_path: Path) -> None:
    stranger = SecretKey.generate()
    npub = encode_npub(stranger.public_key_hex)
    async with in_process_bridge(
        tmp_path, "push.db", relays=[{"url": CONFIGURED}],
        server={"allow_insecure_relays": True},
    ) as parts:
        before, _ = _series()
        counts: list[int] = []
        sizes: list[int] = []
        watched = 0
        for round_number in range(ROUNDS):
            for n in range(NPUBS_PER_ROUND):
                user = SecretKey.generate()
                relays = [f"ws://127.0.0.1:9/r{round_number}-{n}-{i}"
                          for i in range(RELAYS_PER_NPUB - 1)]
                relays.append(f"ws://127.0.0.1:9/{npub}/{round_number}-{n}")
                await parts.devices.register(
                    user.public_key_hex, "android", f"fcm-{round_number}-{n}", "opaque",
                    relays, None, 0,
                )
            watched += NPUBS_PER_ROUND * RELAYS_PER_NPUB
            await eventually(
                lambda watched=watched: len(parts.bridge.health()) >= watched + 1,
                f"round {round_number}'s relays opened", timeout=60.0,
            )
            labels, count = _series()
            assert labels - before <= {CONFIGURED, USER_RELAYS}, sorted(labels - before)[:5]
            counts.append(count)
            sizes.append(len(generate_latest(REGISTRY)))
        # from 30 to 120 user relays watched: not one relay-labelled series more
        assert counts[-1] == counts[0], counts
        assert sizes[-1] - sizes[0] < 2_000, sizes  # counter values grow a digit or two
        text = generate_latest(REGISTRY).decode()
        assert npub not in text and "127.0.0.1:9/r" not in text
        assert 'sigil_push_relay_connected_bool{relay="user"} 0.0' in text
        # the admin detail and the observation records still name each relay (redacted)
        assert f"ws://127.0.0.1:9/r{ROUNDS - 1}-0-0" in parts.bridge.health()
        seen: set[str] = set()

        def recorded() -> bool:
            for path in (tmp_path / "observations").glob("*.jsonl"):
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    if record.get("type") == "relay":
                        seen.add(record["relay"])
            return "ws://127.0.0.1:9/r0-0-0" in seen

        await eventually(recorded, "a user relay's record names its URL", timeout=60.0)
        assert not any(npub in relay for relay in seen)
        assert any("<key-" in relay for relay in seen)
