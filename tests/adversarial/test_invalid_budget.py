"""A relay that floods forged events: each socket may cost only its invalid-event budget
before it is dropped, the relay is backed off exponentially (visible in /health detail and the
metrics), and a good relay's DM is still handed to the outbox meanwhile. In process: a
loopback hostile relay and a loopback good relay, the real bridge on a SQLite file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.relays.budget import INVALID_BURST, ConnectionBudget
from testkit.in_process import in_process_bridge
from tests.adversarial.hostile import HostileRelay, eventually, hostile_relay

VICTIM = SecretKey.generate()
FORGER = SecretKey.generate()


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _forgeries(count: int) -> list[str]:
    """Well-formed kind 4 events with correct ids and current times, signed by someone else."""
    other = sign_event(FORGER, 4, "x", [["p", FORGER.public_key_hex]]).sig
    frames = []
    for i in range(count):
        event = sign_event(FORGER, 4, f"forged {i}", [["p", VICTIM.public_key_hex]]).to_json()
        event["sig"] = other
        frames.append(json.dumps(event))
    return frames


async def test_forged_flood_drops_the_socket_and_backs_the_relay_off(tmp_path: Path) -> None:
    forged = _forgeries(600)
    floods: list[int] = []

    async def flood(relay: HostileRelay, ws: ServerConnection, frame: Any) -> None:
        if frame[0] != "REQ":
            return
        await ws.send(json.dumps(["EOSE", frame[1]]))
        sent = 0
        try:
            for _ in range(20):  # up to 12,000 forgeries per socket, unless it is dropped
                for event in forged:
                    await ws.send(f'["EVENT","{frame[1]}",{event}]')
                    sent += 1
        except ConnectionClosed:
            pass
        floods.append(sent)

    async with hostile_relay(flood) as evil:
        relays = [{"url": evil.url}]
        async with in_process_bridge(tmp_path, "push.db", relays) as parts:
            await parts.devices.register(
                VICTIM.public_key_hex, "android", "fcm-victim", "opaque", (), None, 0
            )
            await eventually(
                lambda: _sample("sigil_push_relay_invalid_drops_total", relay=evil.url) >= 2,
                "the flooding socket dropped twice", timeout=60.0,
            )
            detail = parts.bridge.health()[evil.url]
            assert detail["invalid_drops"] >= 2
            forged_counted = _sample(
                "sigil_push_bridge_events_dropped_total", relay=evil.url, reason="forged"
            )
            # each socket got to cost about its budget, not the 12,000 frames sent at it
            dropped_sockets = detail["invalid_drops"] + 1
            assert forged_counted <= dropped_sockets * (INVALID_BURST + 50)
            # the second drop waited at least 2 s x jitter 0.5: the backoff was not reset by
            # the EOSE the relay answered before flooding
            await eventually(
                lambda: parts.bridge.health()[evil.url]["backoff_until"] is not None
                or _sample("sigil_push_relay_invalid_drops_total", relay=evil.url) >= 3,
                "backing off", timeout=60.0,
            )
            backoff = _sample("sigil_push_relay_backoff_seconds", relay=evil.url)
            until = parts.bridge.health()[evil.url]["backoff_until"]
            if until is not None:
                assert backoff >= 1.0
                assert until >= int(time.time())


async def test_a_per_user_socket_pays_for_its_own_invalid_events(tmp_path: Path) -> None:
    """Events from a user's own (delegated AUTH) socket to a gated relay charge that socket's
    budget, not the shared one's: once they were charged to nobody, so a gated relay could
    feed forgeries through per-user sockets without end."""
    forged = [json.loads(frame) for frame in _forgeries(int(INVALID_BURST) + 20)]
    url = "wss://gated.example"
    async with in_process_bridge(tmp_path, "push.db") as parts:
        await parts.devices.register(
            VICTIM.public_key_hex, "android", "fcm-victim", "opaque", (), None, 0
        )
        await eventually(lambda: VICTIM.public_key_hex in parts.bridge._registry.keys,
                         "the key watched")
        own, other = ConnectionBudget(), ConnectionBudget()
        now_ms = int(time.time() * 1000)
        for event in forged:
            parts.bridge.port.ingest.user_event(url, VICTIM.public_key_hex, event, now_ms, False, own)
        parts.bridge.port.ingest.user_event(url, VICTIM.public_key_hex, forged[0], now_ms, False, other)
        assert own.exceeded
        assert not other.exceeded
