"""Hostile public events (issue 32) fed to a real bridge on a firehose: a kind 1 naming 10,000
keys, zaps whose `description` is not JSON, not a zap request or forged. Each is handled and
counted, nothing crashes, and another user's DM that follows is still handed to the outbox."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client import REGISTRY

from sigil_push.bridge.watches import notify_mask
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.records import PreferenceChange
from testkit.fakes.harness import eventually as poll
from testkit.in_process import InProcessBridge, in_process_bridge
from testkit.stores import Engine

RELAY = "ws://127.0.0.1:9"  # nothing listens: frames are fed to the bridge directly


def _frame(event: dict[str, object]) -> str:
    return json.dumps(["EVENT", "sp0.1", event], separators=(",", ":"))


def _now_ms() -> int:
    return int(time.time() * 1000)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _outbox(parts: InProcessBridge) -> set[str]:
    return {str(row[0]) for row in await parts.db.execute_fetchall("SELECT event_id FROM outbox")}


async def test_a_10000_key_hellthread_and_broken_zaps_cost_no_one_else(
    tmp_path: Path, engine: Engine
) -> None:
    async with in_process_bridge(
        tmp_path, engine.database("push.db"), [{"url": RELAY, "mode": "firehose"}]
    ) as parts:
        alice, bob, mallory = (SecretKey.generate() for _ in range(3))
        for key, token in ((alice, "fcm-alice"), (bob, "fcm-bob")):
            await parts.devices.register(key.public_key_hex, "android", token, "opaque", (),
                                         None, 0)
        await parts.devices.set_preferences(
            alice.public_key_hex, "fcm-alice",
            PreferenceChange(notify=notify_mask(["mention", "zap"])),
        )
        await poll(lambda: RELAY in parts.bridge._pool.subs
                   and {alice.public_key_hex, bob.public_key_hex}
                   <= parts.bridge._pool.subs[RELAY].keys.keys()
                   and 1 in parts.bridge._pool.plan.kinds.get(alice.public_key_hex, ()),
                   what="both watched, alice for mentions")
        me = alice.public_key_hex
        crowd = [["p", SecretKey.generate().public_key_hex] for _ in range(9_999)]
        hellthread = sign_event(mallory, 1, "everyone", [*crowd, ["p", me]]).to_json()
        crowded = _sample("sigil_push_suppressed_total", reason="crowded")
        assert parts.bridge.pool.deliver_text(RELAY, _frame(hellthread), _now_ms())

        def zap(description: str) -> dict[str, object]:
            return sign_event(SecretKey.generate(), 9735, "",
                              [["p", me], ["description", description]]).to_json()

        request = sign_event(mallory, 9734, "", [["p", me]]).to_json()
        forged = {**request, "content": "changed"}
        wrong_kind = sign_event(mallory, 1, "", [["p", me]]).to_json()
        zaps = {
            "not_json": zap("{not json"),
            "invalid": zap(json.dumps(wrong_kind)),
            "forged": zap(json.dumps(forged)),
            "valid": zap(json.dumps(request)),
        }
        before = {o: _sample("sigil_push_bridge_zap_requests_total", outcome=o) for o in zaps}
        for event in zaps.values():
            assert parts.bridge.pool.deliver_text(RELAY, _frame(event), _now_ms())
        dm = sign_event(mallory, 4, "still here", [["p", bob.public_key_hex]]).to_json()
        assert parts.bridge.pool.deliver_text(RELAY, _frame(dm), _now_ms())

        async def handled() -> bool:
            return {str(z["id"]) for z in zaps.values()} | {str(dm["id"])} <= await _outbox(
                parts
            )

        await poll(handled, 60, "the zaps and the DM handed to the outbox")
        await poll(lambda: _sample("sigil_push_suppressed_total", reason="crowded")
                   == crowded + 1, 60, "the hellthread suppressed as crowded")
        assert str(hellthread["id"]) not in await _outbox(parts)
        for outcome in zaps:
            assert _sample("sigil_push_bridge_zap_requests_total", outcome=outcome) == (
                before[outcome] + 1
            ), outcome
