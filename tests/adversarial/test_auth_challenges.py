"""NIP-42 challenges from a hostile relay: one longer than 256 bytes is refused before it is
kept or signed (a 1 MiB challenge once went back in a signed tag and stayed in memory until the
socket closed); a normal challenge after it is still answered. Only digests are kept. A real
`RelayConnection` against a loopback relay in the test's loop; no store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY
from websockets.asyncio.server import ServerConnection

from sigil_push.relays.connection import MAX_CHALLENGE_BYTES
from sigil_push.relays.labels import USER_RELAYS
from tests.adversarial.hostile import HostileRelay, bridge_connection, eventually, hostile_relay

HUGE = "h" * (1024 * 1024)


async def test_oversized_challenges_are_refused_unsigned(tmp_path: Path) -> None:
    challenges = [
        HUGE,
        "ä" * (MAX_CHALLENGE_BYTES // 2 + 1),  # 129 characters, 258 bytes
        "fine-challenge",
    ]

    async def storm(relay: HostileRelay, ws: ServerConnection, frame: Any) -> None:
        if frame[0] == "REQ":
            for challenge in challenges:
                await ws.send(json.dumps(["AUTH", challenge]))
            await ws.send(json.dumps(["EOSE", frame[1]]))

    def refused() -> float:  # a relay nobody configured: its series is the users' shared one
        return REGISTRY.get_sample_value(
            "sigil_push_relay_auth_refused_total", {"relay": USER_RELAYS}
        ) or 0.0

    refused_before = refused()
    async with hostile_relay(storm) as relay, bridge_connection(relay, tmp_path) as connection:
        await eventually(lambda: bool(relay.sent("AUTH")), "the short challenge answered")
        # answers go out in the order the challenges came: the long ones would be first
        answers = relay.sent("AUTH")
        assert len(answers) == 1
        tags = answers[0][1]["tags"]
        assert ["challenge", "fine-challenge"] in tags
        assert refused() - refused_before == 2
        kept = connection._challenges
        assert len(kept) == 1 and all(isinstance(c, bytes) and len(c) == 32 for c in kept)
