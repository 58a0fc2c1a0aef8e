"""Hostile kind 10000 / kind 3 lists reaching the bridge (issue 20), on both engines: an
in-process bridge subscribed to a loopback relay that answers every REQ with lists made to
hurt, signed by nostr-sdk. None of them crashes anything; each is refused and counted, or cut.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import nostr_sdk
from prometheus_client import REGISTRY

from testkit.fakes.harness import eventually
from testkit.in_process import in_process_bridge
from testkit.stores import Engine, fetch
from tests.adversarial.hostile_relay import ReplayRelay

DEADLINE = 60.0


class ListRelay(ReplayRelay):
    """Answers each REQ with EOSE and then its events (so they arrive live), taking frames of
    any size (the hostile lists are larger than websockets' default 1 MiB)."""

    def __init__(self) -> None:
        super().__init__([])

    def _serve_options(self) -> dict[str, Any]:
        return {"max_size": None}


def _signed(owner: nostr_sdk.Keys, kind: int, tags: list[list[str]], created_at: int) -> dict[str, Any]:
    builder = nostr_sdk.EventBuilder(nostr_sdk.Kind(kind), "").tags(
        [nostr_sdk.Tag.parse(tag) for tag in tags]
    ).custom_created_at(nostr_sdk.Timestamp.from_secs(created_at))
    return dict(json.loads(builder.finalize(owner).as_json()))


def _dropped(url: str, reason: str) -> float:
    return REGISTRY.get_sample_value(
        "sigil_push_bridge_events_dropped_total", {"relay": url, "reason": reason}
    ) or 0.0


async def test_hostile_lists_are_refused_or_cut_and_counted(tmp_path: Path, engine: Engine) -> None:
    """A 100,000-tag list (10,500 keys) is kept with its first 10,000 keys, the cut counted; a
    newer list with a bad signature, one dated a day ahead, and one signed by someone else
    change nothing of the user's stored list."""
    owner, other = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    pubkey = str(owner.public_key().to_hex())
    now = int(time.time())
    keys = [f"{n:064x}" for n in range(1, 10_501)]
    huge = _signed(owner, 10000, [["p", k] for k in keys] + [["t", "x"]] * 89_500, now - 60)
    forged = _signed(owner, 10000, [["p", "ab" * 32]], now - 30)
    forged["sig"] = forged["sig"][:-4] + ("0000" if forged["sig"][-4:] != "0000" else "1111")
    future = _signed(owner, 10000, [["p", "cd" * 32]], now + 24 * 3600)
    foreign = _signed(other, 3, [["p", "ef" * 32]], now)
    async with ListRelay() as relay:
        relay.events = [huge, forged, future, foreign]
        database = engine.database("push.db")
        async with in_process_bridge(tmp_path, database, [{"url": relay.url}]) as parts:
            forged_before, future_before = _dropped(relay.url, "forged"), _dropped(relay.url, "too_new")
            truncated_before = REGISTRY.get_sample_value(
                "sigil_push_bridge_user_lists_total", {"outcome": "truncated"}) or 0.0
            await parts.devices.register(pubkey, "android", "fcm-" + "a" * 40, "opaque", (), None, 0)
            stored = "SELECT kind, event_id, entry_count, truncated FROM user_lists"
            target = database if "://" in database else str(tmp_path / database)
            await eventually(lambda: fetch(target, stored), DEADLINE, "the list stored")
            await eventually(lambda: _dropped(relay.url, "forged") > forged_before
                             and _dropped(relay.url, "too_new") > future_before,
                             DEADLINE, "the forged and the future list counted")
            assert fetch(target, stored) == [(10000, huge["id"], 10_000, 500)]
            assert (REGISTRY.get_sample_value("sigil_push_bridge_user_lists_total",
                                              {"outcome": "truncated"}) or 0.0) > truncated_before
            [device] = await parts.devices.of_pubkey(pubkey)
            assert device.rules is not None and device.rules.mute_list
            assert not device.rules.follows_known, "the other author's kind 3 is not the user's"
